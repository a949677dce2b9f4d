"""The rules for the rollout engine, the data, the reward, DAPO's dynamic sampling and the trainer's schedule
and checkpoints."""

from __future__ import annotations

import math

from mcore_rl.algo_config import AlgoConfig
from mcore_rl.from_verl.keys import FG, OB, OB_RECIPE, R
from mcore_rl.from_verl.verl_run import VerlRun, int_or_note, truthy


def rollout(run: VerlRun) -> None:
    name = str(run.get(R + "name"))
    engine = {"vllm": "vllm", "hf": "embedded"}.get(name)
    if not run.given(R + "name"):
        run.set("rollout.engine", "vllm", source=f"{R}name not set (verl requires it): vllm")
    elif engine is None:
        run.mark(R + "name", "not supported", "rollout.engine", f"{name}: vllm instead")
        run.set("rollout.engine", "vllm", source=f"{run.source(R + 'name')} is not supported: vllm instead")
    else:
        run.set("rollout.engine", engine, R + "name")
    tp = int_or_note(run.get(R + "tensor_model_parallel_size"), "rollout tp", run.out.notes) or 1
    run.set("rollout.tp", tp, R + "tensor_model_parallel_size")
    dp = run.as_int(R + "data_parallel_size", 1)
    world = run.out.world
    why = f"{tp} x {dp}: here world {world} / rollout.tp {tp} = {world // max(tp, 1)} replicas"
    run.mark(R + "data_parallel_size", "mapped", "", why)
    for key, what in (
        (R + "expert_parallel_size", "experts are tensor-parallel in each replica"),
        (R + "pipeline_model_parallel_size", "each replica is tensor-parallel only"),
    ):
        size = run.as_int(key, 1)
        run.mark(key, "mapped" if size == 1 else "not supported", "", "1" if size == 1 else f"{size}: {what}")
    run.set("rollout.gpu_memory_utilization", run.as_float(R + "gpu_memory_utilization"), R + "gpu_memory_utilization")
    run.set("rollout.enforce_eager", truthy(run.get(R + "enforce_eager")), R + "enforce_eager")
    temperature = run.as_float(R + "temperature")
    run.set("rollout.temperature", temperature, R + "temperature")
    run.set("algo.temperature", temperature, R + "temperature")
    run.set("rollout.top_p", run.as_float(R + "top_p"), R + "top_p")
    top_k = run.as_int(R + "top_k")
    run.set("rollout.top_k", -1 if top_k <= 0 else top_k, R + "top_k")
    if not truthy(run.get(R + "do_sample")):
        run.mark(R + "do_sample", "not supported", "", "false: training samples here")
    else:
        run.mark(R + "do_sample", "mapped", "", "true: sampling")
    _validation_sampling(run)
    bucket = R + "checkpoint_engine.update_weights_bucket_megabytes"
    if run.given(bucket):
        run.set("rollout.sync_bucket_mb", run.as_float(bucket), bucket)


def _validation_sampling(run: VerlRun) -> None:
    keys = [R + f"val_kwargs.{k}" for k in ("do_sample", "temperature", "n", "top_p", "top_k")]
    greedy = not truthy(run.get(keys[0])) or run.as_float(keys[1], 0) == 0
    one = run.as_int(keys[2], 1) == 1
    for key in keys:
        if greedy and one:
            run.mark(key, "not needed", "", "validation here is greedy pass@1, as these settings")
        else:
            run.mark(
                key, "not supported", "", "validation here is greedy pass@1 (one greedy sample per prompt), not sampled"
            )


def _one_file(run: VerlRun, key: str, target: str) -> None:
    value = run.get(key)
    if isinstance(value, list):
        if len(value) > 1:
            run.mark(key, "not supported", target, f"{len(value)} files: the first only ({value[0]})")
        value = value[0] if value else ""
    run.set(target, str(value or ""), key)


def data(run: VerlRun) -> None:
    _one_file(run, "data.train_files", "data.train_path")
    _one_file(run, "data.val_files", "data.val_path")
    run.set("data.prompt_key", str(run.get("data.prompt_key")), "data.prompt_key")
    run.set("data.max_prompt_len", run.as_int("data.max_prompt_length"), "data.max_prompt_length")
    run.set("rollout.max_new_tokens", run.as_int("data.max_response_length"), "data.max_response_length")
    run.set("data.shuffle", truthy(run.get("data.shuffle")), "data.shuffle")
    if run.get("data.seed") is not None:
        run.set("data.seed", run.as_int("data.seed"), "data.seed")
    samples = run.as_int("data.val_max_samples", -1)
    if samples > 0:
        run.set("trainer.val_prompts", samples, "data.val_max_samples")
    else:
        run.mark(
            "data.val_max_samples",
            "not supported",
            "trainer.val_prompts",
            "-1 (all): validation here takes trainer.val_prompts prompts",
        )
    trunc = str(run.get("data.truncation"))
    run.mark(
        "data.truncation",
        "not needed" if trunc == "error" else "not supported",
        "",
        (
            "error: too-long prompts are dropped and counted here (verl stops)"
            if trunc == "error"
            else f"{trunc}: here a too-long prompt is dropped and counted, never cut"
        ),
    )


def reward(run: VerlRun) -> None:
    manager_key = "reward_model.reward_manager"
    if run.given("reward_manager.name") and not run.given(manager_key):
        manager_key = "reward_manager.name"
    manager = str(run.get(manager_key))
    if manager in ("naive", "dapo", "prime"):
        run.set(
            "reward.fn",
            "math",
            manager_key,
            source=(
                f"{run.source(manager_key)}: verl scores by data_source (math answers for DAPO-Math / GSM8K / MATH); "
                f"math here (math-verify)"
            ),
        )
    else:
        run.mark(manager_key, "not supported", "reward.fn", f"{manager}: math instead")
        run.set("reward.fn", "math", source=f"{run.source(manager_key)} is not supported: math instead")
    if truthy(run.get("reward_model.enable")):
        run.mark("reward_model.enable", "not supported", "", "a reward model: rule-based reward.fn instead")
    else:
        run.mark("reward_model.enable", "not needed", "", "false: rule-based rewards")
    path = run.get("custom_reward_function.path")
    if path:
        name = run.get("custom_reward_function.name")
        why = (
            f"{path}: reward.fn takes package.module:function - make the file importable and set "
            f"reward.fn=MODULE:{name}; math meanwhile"
        )
        run.mark("custom_reward_function.path", "not supported", "reward.fn", why)
        run.mark("custom_reward_function.name", "not supported", "reward.fn", "with custom_reward_function.path")
    else:
        run.mark("custom_reward_function.name", "no effect in verl", "", "custom_reward_function.path is not set")
    _overlong(run, manager)


def _overlong(run: VerlRun, manager: str) -> None:
    prefix = _overlong_prefix(run)
    enable, length, factor = prefix + "enable", prefix + "len", prefix + "penalty_factor"
    max_resp = "reward_model.reward_kwargs.max_resp_len"
    keys = (enable, length, factor, max_resp)
    if manager != "dapo":
        for key in keys:
            run.mark(key, "no effect in verl", "", f"read by the dapo reward manager only ({manager} here)")
        run.set("reward.overlong_buffer", 0, source=f"{run.source('reward_model.reward_manager')}: no overlong penalty")
        return
    if not truthy(run.get(enable)):
        run.set("reward.overlong_buffer", 0, enable, source=f"{run.source(enable)}: no overlong penalty")
        for key in (length, factor, max_resp):
            run.mark(key, "no effect in verl", "", "overlong_buffer_cfg.enable is false")
        return
    buffer = run.as_int(length, 0)
    if buffer <= 0:
        run.mark(enable, "not supported", "reward.overlong_buffer", "enabled without overlong_buffer_cfg.len: off")
        run.set("reward.overlong_buffer", 0, source=f"{run.source(enable)} without a length: off")
        return
    run.set("reward.overlong_buffer", buffer, enable, length)
    run.set("reward.overlong_penalty", run.as_float(factor, 1.0), factor)
    response = run.as_int("data.max_response_length")
    if run.given(max_resp):
        same = run.as_int(max_resp) == response
        run.mark(
            max_resp,
            "mapped" if same else "not supported",
            "",
            (
                "= data.max_response_length (overlong is measured against rollout.max_new_tokens here)"
                if same
                else f"{run.get(max_resp)} != data.max_response_length {response}: here the penalty is measured against "
                f"rollout.max_new_tokens"
            ),
        )


def _overlong_prefix(run: VerlRun) -> str:
    """Where the script sets the overlong buffer: verl's reward_kwargs.overlong_buffer_cfg, else the DAPO
    recipe's reward_model.overlong_buffer (the other form's keys, if both are given, are marked unread)."""
    parts = ("enable", "len", "penalty_factor", "log")
    if not any(run.given(OB_RECIPE + k) for k in parts) or any(run.given(OB + k) for k in parts):
        other, prefix = OB_RECIPE, OB
    else:
        other, prefix = OB, OB_RECIPE
    for k in parts:
        run.mark(other + k, "no effect in verl", "", f"{prefix}* sets the overlong buffer")
    return prefix


def dynamic_sampling(run: VerlRun) -> None:
    """DAPO's group filtering (verl's DAPO recipe trainer) -> algo.dynamic_sampling (docs/dynamic-sampling.md).
    After `reward`: whether verl's acc / score metric differs from the rewards here depends on the buffer."""
    enable = FG + "enable"
    rest = (FG + "metric", FG + "max_num_gen_batches", "data.gen_batch_size")
    if not truthy(run.get(enable)):
        run.mark(enable, "mapped", "algo.dynamic_sampling", "false: off (the default here too)")
        for key in rest:
            run.mark(key, "no effect in verl", "", "filter_groups.enable is false")
        return
    run.set("algo.dynamic_sampling", True, enable)
    _filter_metric(run)
    _round_cap(run)


def _filter_metric(run: VerlRun) -> None:
    key = FG + "metric"
    metric = run.get(key)
    buffer = run.out.settings["reward.overlong_buffer"].value
    if metric is None:
        run.out.notes.append(
            f"{key} is not set: verl's DAPO trainer needs one (it fails at the first step); here a group's "
            "rewards decide (verl's seq_reward)"
        )
    elif metric in ("seq_reward", "seq_final_reward"):
        run.mark(key, "mapped", "algo.dynamic_sampling", f"{metric}: the rewards with the overlong penalty, as here")
    elif metric in ("acc", "score") and not buffer:
        run.mark(key, "mapped", "algo.dynamic_sampling", f"{metric}: without an overlong buffer the rewards, as here")
    elif metric in ("acc", "score"):
        why = (
            f"mapped, differs: verl compares {metric} before the overlong penalty, here the rewards with it "
            "(a group equally correct but unequally penalised is dropped there, kept here)"
        )
        run.mark(key, "mapped", "algo.dynamic_sampling", why)
    else:
        run.mark(key, "not supported", "algo.dynamic_sampling", f"{metric}: here a group's rewards decide")


def _round_cap(run: VerlRun) -> None:
    """verl's cap counts generation batches of gen_batch_size prompts; a round here is data.prompts_per_step
    (train_batch_size) prompts, so the cap keeps verl's prompt budget."""
    cap_key, size_key = FG + "max_num_gen_batches", "data.gen_batch_size"
    prompts = run.out.settings["data.prompts_per_step"].value
    size = run.as_int(size_key, prompts)
    if run.given(size_key):
        same = size == prompts
        why = (
            "= train_batch_size: a round's prompts"
            if same
            else (
                f"{size} != train_batch_size {prompts}: a round here generates data.prompts_per_step = {prompts} "
                "prompts (the round cap keeps verl's prompt budget)"
            )
        )
        run.mark(size_key, "mapped" if same else "not supported", "algo.dynamic_sampling_max_rounds", why)
    batches = run.as_int(cap_key, 0)
    if batches <= 0:
        default = AlgoConfig().dynamic_sampling_max_rounds
        why = (
            f"{batches}: verl has no cap; not supported: {default} rounds (the default), then the step trains on "
            "the groups it has, with a warning"
        )
        run.mark(cap_key, "not supported", "algo.dynamic_sampling_max_rounds", why)
        source = f"{run.source(cap_key)} (no cap) is not supported"
        run.set("algo.dynamic_sampling_max_rounds", default, source=f"{source}: the default")
        run.set("algo.dynamic_sampling_at_cap", "train", source=f"{source}: train on the groups there are")
        return
    rounds = math.ceil(batches * size / prompts)
    scaled = "" if size == prompts else f" x gen_batch_size {size} / train_batch_size {prompts}, rounded up"
    run.set("algo.dynamic_sampling_max_rounds", rounds, cap_key, source=f"{run.source(cap_key)}{scaled}")
    run.set(
        "algo.dynamic_sampling_at_cap", "error", source=f"{run.source(cap_key)}: verl stops with an error at the cap"
    )


def trainer(run: VerlRun) -> None:
    steps_key, epochs_key = "trainer.total_training_steps", "trainer.total_epochs"
    steps = run.as_int(steps_key, -1)
    if steps >= 0:
        run.set("trainer.steps", steps, steps_key)
        run.mark(epochs_key, "not needed", "", "total_training_steps decides the steps")
    else:
        run.mark(
            epochs_key,
            "not supported",
            "trainer.steps",
            "verl's steps = epochs x (dataset rows / "
            "train_batch_size); the dataset is not read here: set trainer.steps",
        )
        run.out.notes.append("trainer.total_training_steps is not set: trainer.steps stays at 100; set it by hand")
    save = run.as_int("trainer.save_freq")
    run.set("checkpoint.save_every", max(save, 0), "trainer.save_freq")
    test = run.as_int("trainer.test_freq")
    run.set("trainer.val_every", max(test, 0), "trainer.test_freq")
    if truthy(run.get("trainer.val_before_train")):
        run.mark(
            "trainer.val_before_train",
            "not supported",
            "",
            "true: validation here runs every trainer.val_every steps, the first after step val_every",
        )
    else:
        run.mark("trainer.val_before_train", "mapped", "", "false: none before step 1 (none here either)")
    logger = run.get("trainer.logger")
    loggers = logger if isinstance(logger, list) else [logger]
    run.set("trainer.wandb", "wandb" in [str(x) for x in loggers], "trainer.logger")
    if run.given("trainer.project_name"):
        run.set("trainer.wandb_project", str(run.get("trainer.project_name")), "trainer.project_name")
    name = run.get("trainer.experiment_name")
    run.set("trainer.run_dir", f"runs/{name}", "trainer.experiment_name")
    mode = str(run.get("trainer.resume_mode"))
    if mode == "resume_path":
        run.set(
            "checkpoint.resume",
            str(run.get("trainer.resume_from_path")),
            "trainer.resume_mode",
            "trainer.resume_from_path",
        )
    elif mode in ("auto", "disable"):
        run.set("checkpoint.resume", "auto" if mode == "auto" else "never", "trainer.resume_mode")
        run.mark("trainer.resume_from_path", "no effect in verl", "", f"resume_mode={mode}")
    else:
        run.mark("trainer.resume_mode", "not supported", "checkpoint.resume", f"{mode}: auto instead")
    keep = run.as_int("trainer.max_actor_ckpt_to_keep", 0)
    if keep >= 1:
        run.set("checkpoint.keep_last", keep, "trainer.max_actor_ckpt_to_keep")
    elif run.given("trainer.max_actor_ckpt_to_keep"):
        run.mark(
            "trainer.max_actor_ckpt_to_keep",
            "not supported",
            "checkpoint.keep_last",
            f"{keep}: keep-all is not a choice here; checkpoint.keep_last 2",
        )
