"""benchmarks/demo_speed.py's TRL baseline (issue 34): configured as TRL's users would for the demo's 260k-parameter
model, and with mcore-rl's objective. TRL 1.16's GRPOConfig defaults gradient_checkpointing to True, and with
router_aux_loss_coef unset it adds the model config's load-balancing loss (0.001 in the tiny Qwen3-MoE), which
mbridge's Qwen3-MoE leaves out (moe_router_load_balancing_type "none"). The TRL run itself reads both back from the
trainer it built and refuses to time an unfair baseline (`trl_effective`, in TRL's venv)."""

import pytest

from benchmarks.demo_speed import trl_settings, trl_spec
from mcore_rl.config import load_config
from tests.torchrun_util import REPO


@pytest.mark.parametrize("preset", ["gspo_cpu.yaml", "gspo_multitoken_cpu.yaml"])
def test_trl_baseline_runs_without_gradient_checkpointing_or_auxiliary_loss(preset):
    cfg = load_config(REPO / "configs/tiny" / preset, validate=False)
    settings = trl_settings(trl_spec(cfg, 1, "unused", 30, 2))
    assert settings["gradient_checkpointing"] is False
    assert settings["router_aux_loss_coef"] == 0.0
    # and the preset's own hyperparameters, as before
    o = cfg.actor.optim
    assert (settings["learning_rate"], settings["max_grad_norm"], settings["adam_epsilon"]) == (
        o.lr,
        o.clip_grad,
        o.adam_eps,
    )
    assert settings["per_device_train_batch_size"] * cfg.algo.mini_batches == cfg.data.prompts_per_step * cfg.rollout.n
    assert (settings["epsilon"], settings["epsilon_high"]) == (cfg.algo.clip_low, cfg.algo.clip_high)
    assert settings["max_completion_length"] == cfg.rollout.max_new_tokens and settings["beta"] == 0.0
