"""Config loading: YAML + typed dotted overrides, unknown keys, wrong types, choices, combinations, save/load."""

import dataclasses

import pytest
import yaml

from mcore_rl.config import (
    CHOICES,
    Config,
    ConfigError,
    check_paths,
    load_config,
    save_config,
    validate_config,
)
from tests.torchrun_util import REPO


def write(tmp_path, text: str):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def error(*overrides: str, path=None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_yaml_and_typed_overrides(tmp_path):
    path = write(tmp_path, "algo:\n  loss: grpo\n  kl_coef: 1e-3\nactor:\n  parallel:\n    tp: 2\n    ep: 2\n")
    cfg = load_config(
        path,
        [
            "algo.loss=gspo_token",
            "actor.parallel.tp=1",
            "actor.optim.lr=3e-6",
            "algo.dual_clip=3",
            "algo.rollout_is=null",
            "algo.routing_replay=r2",
            "trainer.tensorboard=false",
            "model.path=123",
            "trainer.run_dir=runs/1e3",
        ],
    )
    assert cfg.algo.loss == "gspo_token" and cfg.actor.parallel.tp == 1 and cfg.actor.parallel.ep == 2
    assert cfg.algo.kl_coef == pytest.approx(1e-3) and isinstance(
        cfg.algo.kl_coef, float
    )  # YAML 1.1 "1e-3" is a string
    assert cfg.actor.optim.lr == pytest.approx(3e-6)
    assert cfg.algo.dual_clip == 3.0 and isinstance(cfg.algo.dual_clip, float)
    assert cfg.algo.rollout_is is None and cfg.algo.routing_replay == "r2"
    assert cfg.trainer.tensorboard is False
    assert cfg.model.path == "123" and cfg.trainer.run_dir == "runs/1e3"  # str fields stay verbatim
    # untouched fields keep the dataclass defaults
    assert cfg.rollout == Config().rollout


def test_unknown_keys_list_valid_keys_and_hint(tmp_path):
    msg = error("algo.los=sapo")
    assert (
        "unknown key 'algo.los'" in msg and "valid keys: loss, agg_mode" in msg and "Did you mean 'algo.loss'?" in msg
    )
    msg = error(path=write(tmp_path, "actor:\n  paralel:\n    tp: 2\n"))
    assert "unknown key 'actor.paralel'" in msg and "Did you mean 'actor.parallel'?" in msg
    assert "unknown key 'modell'" in error("modell.path=x") and "Did you mean 'model'?" in error("modell.path=x")
    assert "is a section" in error("algo=3")
    assert "is a value, not a section" in error("algo.loss.x=3")
    assert "has no '='" in error("algo.loss")


def test_wrong_types_rejected(tmp_path):
    assert "actor.parallel.tp: expected int, got 'two'" in error("actor.parallel.tp=two")
    assert "expected int, got 1.5" in error("rollout.n=1.5")
    assert "expected bool" in error("trainer.tensorboard=maybe")
    assert "expected int, got True" in error("rollout.n=true")
    assert "rollout.n: null is not allowed" in error("rollout.n=null")
    assert "model.path: expected str, got 5" in error(path=write(tmp_path, "model:\n  path: 5\n"))
    assert "expected a mapping" in error(path=write(tmp_path, "algo: 3\n"))
    assert "must hold a mapping" in error(path=write(tmp_path, "- 1\n- 2\n"))
    assert "does not exist" in error(path=tmp_path / "missing.yaml")


# choices valid only together with another setting (the rule's own test names the error)
CHOICE_NEEDS = {("algo.proximal", "loglinear"): ["rollout.placement=separate"]}


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_every_enum_field_checked(key):
    msg = error(f"{key}=not_a_choice")
    assert f"{key} = 'not_a_choice' is not one of" in msg
    for choice in CHOICES[key]:
        if choice is not None:
            load_config(None, [f"{key}={choice}", *CHOICE_NEEDS.get((key, choice), [])])


def test_removed_key_named_in_yaml(tmp_path):
    assert "was removed" in error(path=write(tmp_path, "algo:\n  use_rollout_logprobs_as_old: true\n"))


@pytest.mark.parametrize(
    "overrides, from_update",
    [
        ([], True),  # one mini-batch, one epoch: the update's forward gives the old log-probs
        (["algo.routing_replay=r2"], True),  # R2: the update records its own (= the old policy's) routes
        (["algo.routing_replay=r3"], False),  # R3: the update replays the engine's routes, old pass does not
        (["algo.mini_batches=2"], False),  # the second mini-batch sees updated weights
        (["algo.ppo_epochs=2"], False),
        (["algo.old_log_prob_pass=always"], False),
    ],
)
def test_old_log_probs_from_update_only_when_exactly_on_policy(overrides, from_update):
    assert load_config(None, overrides).algo.old_from_update is from_update


def test_close_choice_hint():
    assert "Did you mean 'gspo'?" in error("algo.loss=gpso")


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["algo.temperature=0.7"], "algo.temperature = 0.7 differs from rollout.temperature = 1.0"),
        (["algo.kl_coef=-0.1"], "algo.kl_coef = -0.1 must be >= 0"),
        (["algo.clip_low=1.2"], "algo.clip_low = 1.2 must lie in [0, 1)"),
        (["algo.clip_high=-0.1"], "algo.clip_high = -0.1 must be >= 0"),
        (["algo.loss=sapo", "algo.dual_clip=3"], "loss=sapo has no clipping"),
        (["algo.dual_clip=0.5"], "algo.dual_clip = 0.5 must be > 1"),
        (["rollout.n=1"], "rollout.n = 1: group advantages (grpo) need at least 2 samples"),
        (["algo.rollout_is=icepop", "algo.rollout_is_low=1.5"], "needs rollout_is_low < 1 < rollout_is_high"),
        (
            ["algo.use_rollout_logprobs_as_old=true"],
            "'algo.use_rollout_logprobs_as_old' was removed: exactly on-policy updates now skip",
        ),
        (["rollout.top_p=0"], "rollout.top_p = 0.0 must lie in (0, 1]"),
        (["rollout.top_k=0"], "rollout.top_k = 0 must be -1 (off) or >= 1"),
        (["actor.optim.lr=0"], "actor.optim.lr = 0.0 must be > 0"),
        (["actor.optim.min_lr=1", "actor.optim.lr=0.1"], "min_lr = 1.0 exceeds actor.optim.lr = 0.1"),
        (["actor.optim.adam_beta2=1"], "adam_beta2 = 1.0 must lie in [0, 1)"),
        (["actor.optim.decay_steps=0"], "actor.optim.decay_steps = 0 must be >= 1 or null"),
        (["checkpoint.keep_last=0"], "checkpoint.keep_last = 0 must be >= 1"),
        (["reward.fn=not a function"], "use 'task', 'math' or 'package.module:function'"),
        (
            ["actor.max_tokens_per_micro_batch=4096", "actor.max_tokens_per_forward_micro_batch=2048"],
            "max_tokens_per_forward_micro_batch = 2048 < actor.max_tokens_per_micro_batch = 4096",
        ),
        (["actor.max_tokens_per_forward_micro_batch=2048"], "set the training budget too"),
        (
            ["actor.max_tokens_per_micro_batch=4096", "model.moe_token_dispatcher=allgather", "actor.parallel.ep=2"],
            "use model.moe_token_dispatcher=alltoall",
        ),
    ],
)
def test_impossible_combinations_rejected(overrides, expected):
    assert expected in error(*overrides)


def test_kl_type_without_kl_coef_is_fine_and_warnings_returned():
    cfg = load_config(None, ["algo.kl_type=k1", "algo.kl_coef=0"])
    assert cfg.algo.kl_type == "k1"
    warnings = validate_config(load_config(None, ["algo.loss=gspo", "algo.clip_low=0.2"]))
    assert any("GSPO paper" in w for w in warnings)
    assert validate_config(load_config(None, ["algo.loss=grpo"])) == []


def test_save_then_load_round_trip(tmp_path):
    cfg = load_config(None, ["algo.loss=sapo", "actor.parallel.tp=2", "algo.rollout_is=sequence", "trainer.steps=7"])
    out = tmp_path / "run" / "config.yaml"
    save_config(cfg, out)
    assert yaml.safe_load(out.read_text())["algo"]["loss"] == "sapo"
    assert load_config(out) == cfg
    assert not list(out.parent.glob("*.tmp*"))


def test_defaults_match_dataclasses_and_every_field_is_loadable():
    assert load_config(None) == Config()
    assert validate_config(Config()) is not None

    def leaves(obj, prefix=""):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                yield from leaves(value, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}", value

    # Writing each default back through an override yields the same config (types parse back exactly).
    overrides = [
        f"{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}" for k, v in leaves(Config())
    ]
    assert load_config(None, overrides) == Config()


def test_check_paths(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match="model.path is empty"):
        check_paths(Config())
    cfg = load_config(None, [f"model.path={tmp_path}"])
    with pytest.raises(ConfigError, match="has no config.json"):
        check_paths(cfg)
    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"data.train_path={tmp_path}/none.parquet"])
    with pytest.raises(ConfigError, match="data.train_path = .* does not exist"):
        check_paths(cfg)
    (tmp_path / "train.jsonl").write_text("{}\n")
    cfg = load_config(
        None, [f"model.path={tiny_model_dir}", f"data.train_path={tmp_path}/train.jsonl", "trainer.val_every=5"]
    )
    with pytest.raises(ConfigError, match="trainer.val_every = 5 needs data.val_path"):
        check_paths(cfg)
    check_paths(load_config(None, [f"model.path={tiny_model_dir}", f"data.train_path={tmp_path}/train.jsonl"]))


def test_actor_offload_is_a_checked_bool_and_warns_on_cpu():
    from mcore_rl.config import ConfigError, validate_config

    assert load_config(None, ["actor.offload=true"]).actor.offload is True
    with pytest.raises(ConfigError, match="actor.offload"):
        load_config(None, ["actor.offload=sometimes"])
    warned = validate_config(load_config(None, ["platform=cpu", "actor.offload=true"], validate=False))
    assert any("actor.offload on platform=cpu" in w for w in warned)
    assert not any(
        "actor.offload" in w
        for w in validate_config(load_config(None, ["platform=cuda", "actor.offload=true"], validate=False))
    )


def test_kv_cache_gb_on_npu_warns_that_vllm_ascend_ignores_it():
    from mcore_rl.config import validate_config

    args = ["rollout.engine=vllm", "rollout.kv_cache_gb=8"]
    npu = validate_config(load_config(None, ["platform=npu", *args], validate=False))
    assert any("rollout.kv_cache_gb is ignored by vLLM-Ascend" in w for w in npu)
    assert not any(
        "kv_cache_gb" in w for w in validate_config(load_config(None, ["platform=cuda", *args], validate=False))
    )


def test_vllm_keys_with_the_embedded_engine_warn_that_they_have_no_effect():
    """rollout.tp / gpu_memory_utilization / kv_cache_gb used to be accepted silently with the embedded
    engine; like other keys without effect (kv_cache_gb on vLLM-Ascend) each gets a warning with the fix."""
    from mcore_rl.config import validate_config

    keys = ["rollout.tp=2", "rollout.gpu_memory_utilization=0.8", "rollout.kv_cache_gb=8"]
    warned = validate_config(load_config(None, ["rollout.engine=embedded", *keys], validate=False))
    for key in keys:
        name, value = key.split("=")
        assert any(
            w.startswith(f"{name} = {value}")
            and "no effect with rollout.engine=embedded" in w
            and "rollout.engine=vllm" in w
            for w in warned
        ), (key, warned)
    assert not any(
        "no effect" in w for w in validate_config(load_config(None, ["rollout.engine=embedded"], validate=False))
    )
    vllm = validate_config(load_config(None, ["rollout.engine=vllm", "platform=cuda", *keys], validate=False))
    assert not any("no effect" in w for w in vllm)


@pytest.mark.parametrize("run_dir", ["", "  "])
def test_an_empty_run_dir_is_refused(run_dir):
    from mcore_rl.config import ConfigError

    with pytest.raises(ConfigError, match="trainer.run_dir = .* is empty: .* set it, e.g. trainer.run_dir=runs/my_run"):
        load_config(None, [f"trainer.run_dir={run_dir}"])


@pytest.mark.parametrize(
    "overrides, fix",
    [
        (("rollout.max_staleness=1",), "needs rollout.placement=separate"),
        (("rollout.placement=separate", "rollout.max_staleness=2"), "at most one step ahead"),
        (("rollout.streaming=true",), "rollout.streaming=true with rollout.placement=colocated: streaming generates"),
        (("rollout.placement=separate", "rollout.streaming=true", "rollout.max_staleness=-1"), "never negative"),
    ],
)
def test_placement_value_rules_name_the_fix(overrides, fix):
    assert fix in error(*overrides)


def test_separate_placement_defaults_accepted():
    streaming = ["rollout.placement=separate", "rollout.streaming=true", "rollout.max_staleness=2"]
    for overrides in (
        ["rollout.placement=separate"],
        ["rollout.placement=separate", "rollout.max_staleness=0"],
        streaming,
    ):
        cfg = load_config(None, overrides)
        assert cfg.rollout.placement == "separate"


def test_an_overlong_buffer_beyond_the_response_budget_is_refused():
    """reward.overlong_buffer = 20 with max_new_tokens = 14 passed the pre-flight and every rank then died in
    OverlongPenalty's own check; it is one config error naming the largest buffer that fits."""
    from mcore_rl.rewards.overlong import OverlongPenalty

    preset = str(REPO / "configs/tiny/gspo_multitoken_cpu.yaml")
    with pytest.raises(
        ConfigError, match=r"^reward.overlong_buffer = 20 exceeds rollout.max_new_tokens = 14: .* at most 14"
    ):
        load_config(preset, ["reward.overlong_buffer=20"])
    with pytest.raises(ValueError):  # the reference: the penalty the workers build refuses the same pair
        OverlongPenalty(14, 20, 1.0)
    OverlongPenalty(14, 14, 1.0)
    assert load_config(preset, ["reward.overlong_buffer=14"]).reward.overlong_buffer == 14


def test_overlong_filtering_with_a_one_token_budget_warns():
    """The stop token counts toward rollout.max_new_tokens: with 1, every response but the stop token alone is
    cut, and overlong filtering masks ~99% of the one-token preset's samples; that is a warning with the fix."""
    preset = str(REPO / "configs/tiny/gspo_cpu.yaml")
    warned = validate_config(load_config(preset, ["algo.overlong_filtering=true"], validate=False))
    assert any(w.startswith("algo.overlong_filtering with rollout.max_new_tokens = 1 masks") for w in warned), warned
    for args in (["algo.overlong_filtering=false"], ["algo.overlong_filtering=true", "rollout.max_new_tokens=2"]):
        assert not any("overlong_filtering" in w for w in validate_config(load_config(preset, args, validate=False)))


def test_dynamic_sampling_keys_without_dynamic_sampling_warn_that_they_have_no_effect():
    keys = ["algo.dynamic_sampling_max_rounds=3", "algo.dynamic_sampling_at_cap=error"]
    warned = validate_config(load_config(None, keys, validate=False))
    for key in keys:
        name, value = key.split("=")
        assert any(w.startswith(f"{name} = {value} has no effect without algo.dynamic_sampling") for w in warned), (
            key,
            warned,
        )
    on = validate_config(load_config(None, ["algo.dynamic_sampling=true", *keys], validate=False))
    assert not any("no effect" in w for w in on)
    assert not any("no effect" in w for w in validate_config(load_config(None, [], validate=False)))
