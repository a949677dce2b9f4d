"""The rules for the loss, its clips, KL, advantages, rollout correction, routing replay and the optimiser."""

from __future__ import annotations

from mcore_rl.from_verl.keys import A, R
from mcore_rl.from_verl.verl_run import ConversionError, VerlRun, show, truthy


def loss(run: VerlRun) -> None:
    mode_key = A + "policy_loss.loss_mode"
    mode = str(run.get(mode_key))
    loss = {"vanilla": "grpo", "gspo": "gspo", "sapo": "sapo"}.get(mode)
    if loss is None:
        run.mark(mode_key, "not supported", "algo.loss", f"{mode}: grpo (PPO-clip) instead")
        run.set("algo.loss", "grpo", source=f"{run.source(mode_key)} is not supported: grpo instead")
        loss = "grpo"
    else:
        run.set("algo.loss", loss, mode_key, source=f"{run.source(mode_key)} -> {loss}")
    agg_key = A + "loss_agg_mode"
    if loss == "grpo":
        agg = str(run.get(agg_key))
        if agg not in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
            run.mark(agg_key, "not supported", "algo.agg_mode", f"{agg}: token-mean instead")
            agg = "token-mean"
        run.set("algo.agg_mode", agg, agg_key)
    else:
        run.mark(
            agg_key, "no effect in verl", "algo.agg_mode", f"verl's {mode} loss always aggregates seq-mean-token-mean"
        )
        run.set(
            "algo.agg_mode",
            "seq-mean-token-mean",
            source=(
                f"verl's {mode} loss always aggregates seq-mean-token-mean"
                + (f" ({run.overrides[agg_key].text} has no effect there)" if run.given(agg_key) else "")
            ),
        )
    _clips(run, loss, mode)
    for key, target in ((A + "tau_pos", "algo.tau_pos"), (A + "tau_neg", "algo.tau_neg")):
        if loss == "sapo":
            run.set(target, run.as_float(key), key)
        else:
            run.mark(key, "no effect in verl", target, f"read by the sapo loss only ({mode} here)")
    run.set("algo.entropy_coef", run.as_float(A + "entropy_coeff", 0.0), A + "entropy_coeff")
    _kl(run)
    _advantages(run)
    _rollout_correction(run)
    _routing_replay(run)


def _clips(run: VerlRun, loss: str, mode: str) -> None:
    ratio, low_key, high_key, c_key = (
        A + k for k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c")
    )
    if loss == "sapo":
        for key in (ratio, low_key, high_key, c_key):
            run.mark(key, "no effect in verl", "", "the sapo loss has no clipping (a soft gate)")
        return
    # verl: clip_ratio_low / _high when not null (their defaults are 0.2), else clip_ratio
    low_src = low_key if run.get(low_key) is not None else ratio
    high_src = high_key if run.get(high_key) is not None else ratio
    run.set("algo.clip_low", run.as_float(low_src), low_src)
    run.set("algo.clip_high", run.as_float(high_src), high_src)
    if ratio not in (low_src, high_src):
        run.mark(ratio, "no effect in verl", "", "clip_ratio_low / clip_ratio_high are set (verl's defaults are 0.2)")
    if loss == "grpo":
        run.set(
            "algo.dual_clip",
            run.as_float(c_key),
            c_key,
            source=(f"{run.source(c_key)} - verl's vanilla loss always applies the dual clip"),
        )
    else:
        run.mark(c_key, "no effect in verl", "algo.dual_clip", f"verl's {mode} loss has no dual clip")
        run.set(
            "algo.dual_clip",
            None,
            source=f"verl's {mode} loss has no dual clip"
            + (f" ({run.overrides[c_key].text} has no effect there)" if run.given(c_key) else ""),
        )


def _kl(run: VerlRun) -> None:
    use, coef, kind = A + "use_kl_loss", A + "kl_loss_coef", A + "kl_loss_type"
    if truthy(run.get(use)):
        run.set("algo.kl_coef", run.as_float(coef), use, coef)
        name = str(run.get(kind))
        kl = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}.get(name)
        if kl is None:
            run.mark(kind, "not supported", "algo.kl_type", f"{name}: k3 (low_var_kl) instead")
            kl = "k3"
        run.set("algo.kl_type", kl, kind, source=f"{run.source(kind)} -> {kl}")
    else:
        run.set("algo.kl_coef", 0.0, use, source=f"{run.source(use)}: no KL term")
        for key in (coef, kind):
            run.mark(key, "no effect in verl", "", "use_kl_loss is false")
    in_reward = "algorithm.use_kl_in_reward"
    if truthy(run.get(in_reward)):
        run.mark(
            in_reward,
            "not supported",
            "",
            "KL in the reward: here KL is a loss term (algo.kl_coef); no KL penalty in the reward instead",
        )
        for key in ("algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.type", "algorithm.kl_penalty"):
            run.mark(key, "not supported", "", "KL in the reward is not supported")
    else:
        run.mark(in_reward, "mapped", "", "false: no KL in the reward (none here either)")
        for key in ("algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.type", "algorithm.kl_penalty"):
            run.mark(key, "no effect in verl", "", "use_kl_in_reward is false")


def _advantages(run: VerlRun) -> None:
    key, norm = "algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo"
    estimator = str(run.get(key))
    if estimator == "grpo":
        value = "grpo" if truthy(run.get(norm)) else "drgrpo"
        run.set("algo.adv_estimator", value, key, *([norm] if run.given(norm) else []))
        return
    run.mark(
        key,
        "not supported",
        "algo.adv_estimator",
        f"{estimator}: group advantages (grpo) instead"
        + (" - gae needs a critic, which this project does not train" if estimator == "gae" else ""),
    )
    run.set("algo.adv_estimator", "grpo", source=f"{run.source(key)} is not supported: grpo instead")
    if not run.given(key):
        run.out.notes.append(f"{key} is not set: verl's default {estimator} is not supported here; grpo instead")
    run.mark(norm, "no effect in verl", "", "adv_estimator is not grpo")


def _rollout_correction(run: VerlRun) -> None:
    key, cap = "algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction.rollout_is_threshold"
    mode = run.get(key)
    if mode in (None, "null", "none"):
        run.mark(key, "mapped", "algo.rollout_is", "null: off")
        run.mark(cap, "no effect in verl", "", "rollout_is is off")
        return
    if mode not in ("token", "sequence"):
        run.mark(key, "not supported", "algo.rollout_is", f"{mode}: off instead")
        return
    run.set("algo.rollout_is", mode, key)
    run.set("algo.rollout_is_cap", run.as_float(cap), cap)


def _routing_replay(run: VerlRun) -> None:
    key, r3 = A + "router_replay.mode", R + "enable_rollout_routing_replay"
    mode = str(run.get(key) or "disabled")
    value = {"disabled": None, "R2": "r2", "R3": "r3"}.get(mode, "invalid")
    if value == "invalid":
        run.mark(key, "not supported", "algo.routing_replay", f"{mode}: off instead (disabled / R2 / R3)")
        value = None
    if value is not None or run.given(key):
        run.set("algo.routing_replay", value, key, source=f"{run.source(key)} -> {show(value)}")
    if run.given(r3):
        run.mark(
            r3,
            "mapped",
            "algo.routing_replay",
            "the engine returns its routes for R3 by itself" if value == "r3" else "used by R3 only",
        )


def optim(run: VerlRun) -> None:
    lr = run.as_float(A + "optim.lr")
    run.set("actor.optim.lr", lr, A + "optim.lr")
    run.set("actor.optim.weight_decay", run.as_float(A + "optim.weight_decay"), A + "optim.weight_decay")
    clip_key = A + "optim.clip_grad" if run.strategy == "megatron" else A + "grad_clip"
    run.set("actor.optim.clip_grad", run.as_float(clip_key), clip_key)
    other = A + "grad_clip" if run.strategy == "megatron" else A + "optim.clip_grad"
    run.mark(other, "no effect in verl", "", f"the {run.strategy} actor clips by {clip_key.split('.')[-1]}")
    betas = run.get(A + "optim.betas")
    if isinstance(betas, list) and len(betas) == 2:
        try:
            beta1, beta2 = float(betas[0]), float(betas[1])
        except (TypeError, ValueError):
            raise ConversionError(f"{run.source(A + 'optim.betas')}: expected two numbers") from None
        run.set("actor.optim.adam_beta1", beta1, A + "optim.betas")
        run.set("actor.optim.adam_beta2", beta2, A + "optim.betas")
    name = str(run.get(A + "optim.optimizer"))
    if name.lower() in ("adam", "adamw"):
        run.mark(A + "optim.optimizer", "mapped", "", "Megatron's Adam with decoupled weight decay (AdamW)")
    else:
        run.mark(A + "optim.optimizer", "not supported", "", f"{name}: Adam (decoupled weight decay) instead")
    _schedule(run, lr)


def _schedule(run: VerlRun, lr: float) -> None:
    steps_key, ratio_key = A + "optim.lr_warmup_steps", A + "optim.lr_warmup_steps_ratio"
    steps = run.as_int(steps_key, -1)
    if steps >= 0:
        run.set("actor.optim.warmup_steps", steps, steps_key)
        run.mark(ratio_key, "no effect in verl", "", "lr_warmup_steps is set")
    else:
        total = run.out.settings.get("trainer.steps")
        ratio = run.as_float(ratio_key, 0.0)
        warm = int(ratio * total.value) if total and total.value else 0
        run.set(
            "actor.optim.warmup_steps",
            warm,
            ratio_key,
            source=(f"{run.source(ratio_key)} x {total.value if total else '?'} steps (lr_warmup_steps -1)"),
        )
        run.mark(steps_key, "mapped", "actor.optim.warmup_steps", "-1: from lr_warmup_steps_ratio")
    if run.strategy == "megatron":
        key = A + "optim.lr_decay_style"
        style = str(run.get(key))
        run.set("actor.optim.min_lr", run.as_float(A + "optim.min_lr", 0.0), A + "optim.min_lr")
    else:
        key = A + "optim.lr_scheduler_type"
        if run.given(A + "optim.warmup_style") and not run.given(key):
            key = A + "optim.warmup_style"
        style = str(run.get(key))
        ratio = run.as_float(A + "optim.min_lr_ratio", 0.0)
        run.set(
            "actor.optim.min_lr",
            ratio * lr,
            A + "optim.min_lr_ratio",
            source=(f"{run.source(A + 'optim.min_lr_ratio')} x lr"),
        )
    if style not in ("constant", "linear", "cosine"):
        run.mark(key, "not supported", "actor.optim.decay_style", f"{style}: constant instead")
        style = "constant"
    run.set("actor.optim.decay_style", style, key)
    if run.given(A + "optim.lr_decay_steps") and run.get(A + "optim.lr_decay_steps") is not None:
        run.set("actor.optim.decay_steps", run.as_int(A + "optim.lr_decay_steps"), A + "optim.lr_decay_steps")
