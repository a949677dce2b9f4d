"""The demo against a single-process Hugging Face trainer: time from process start to a 10-step mean reward of 0.8
(or, with --steps N, to the end of step N).

    python benchmarks/demo_speed.py [--preset configs/tiny/gspo_cpu.yaml] [--seeds 1] [--only mcore|trl]
                                    [--threshold 0.8] [--window 10] [--max-steps 300] [--steps N]
                                    [--trl-python PATH] [key=value ...]

    python benchmarks/demo_speed.py --seeds 1 2 3                  # the one-token task (~4 min on a quiet machine)
    python benchmarks/demo_speed.py --preset configs/tiny/gspo_multitoken_cpu.yaml --steps 30 --seeds 1 2 3

The multi-token task (configs/tiny/gspo_multitoken_cpu.yaml, from the warm-start checkpoint) does not reach a
10-step mean of 0.8 within its 200 steps (docs/multitoken-demo.md: 0.27 -> 0.72), and where either trainer's
curve crosses a lower level depends on its seed's luck: there both run the same number of steps (--steps) and
the wall time to the end of that step is compared, with each one's mean reward over the first and the last
`window` steps printed next to it (a faster trainer that learned less shows as such).

Runs, back to back in one invocation and so under the same machine load:
  1. Hugging Face TRL's GRPOTrainer (one process, in the side venv .venv-trl: `make setup-trl`) on the demo's
     task: the same model files, training data, reward function (mcore_rl/rewards/task.py, loaded by path)
     and hyperparameters as the preset (prompts x samples per step, one answer token, temperature, lr, Adam,
     gradient clip, GSPO's sequence-level ratio with the preset's clip range, one optimizer step per mini-batch
     (algo.mini_batches: TRL's steps_per_generation, its old log-probs then from the generating policy), no KL;
     the preset's overlong penalty (reward.overlong_buffer / overlong_penalty) added to the reward the same way,
     from the completion's token count, <|im_end|> included as in mcore-rl's response lengths); configured as
     its users would for a 260k-parameter model, without gradient checkpointing (TRL 1.16's GRPOConfig turns it
     on by default), and without the MoE load-balancing loss, as mcore-rl's Qwen3-MoE (mbridge:
     moe_router_load_balancing_type "none"; TRL would add the model config's router_aux_loss_coef): every
     GRPOConfig argument is printed before the run, and what the built trainer does ("TRL as run") after;
  2. `mcore-rl train PRESET` (torchrun, the preset's own layout; extra key=value overrides are applied).
Each run is stopped as soon as the mean reward of the last `window` steps reaches `threshold` (or after
max-steps), or with --steps N at the end of step N (a step: one batch of prompts x samples, i.e. algo.mini_batches
optimizer steps). Printed per run: wall seconds from launching the process to that step, the step, the median
seconds per step up to it (each trainer's own step boundaries: TRL's on_step_end times, mcore-rl's metrics
rows) and the start-up seconds (launch to the end of the first step minus that step's duration); then
the ratio mcore-rl / TRL of the wall times, per seed and at the end their median and spread (min - max). The
1-minute load average before and after each run is printed too: on a shared machine only runs under similar
load compare. TRL runs in its own venv: `make setup-trl` (.venv-trl), or --trl-python / $MCORE_RL_TRL_PYTHON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
TRL_PYTHON = Path(os.environ.get("MCORE_RL_TRL_PYTHON", REPO / ".venv-trl" / "bin" / "python"))


# ---- the TRL side (runs inside .venv-trl; imports nothing from mcore_rl's package) -------------------------
def trl_worker(spec: dict) -> None:
    """GRPOTrainer on the demo task; prints `STEP <n> <mean reward> <unix time>` after every step (a batch's last
    optimizer step)."""
    import importlib.util

    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(spec["threads"])
    loaded = importlib.util.spec_from_file_location("task_reward", REPO / "mcore_rl" / "rewards" / "task.py")
    task_reward = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(task_reward)

    rows = pq.read_table(spec["train_path"]).to_pylist()
    data = Dataset.from_list(
        [
            {
                "prompt": r["prompt"],
                "ground_truth": str(r["reward_model"]["ground_truth"]),
                "data_source": r["data_source"],
            }
            for r in rows
        ]
    )

    limit, buffer, factor = spec["max_new_tokens"], spec["overlong_buffer"], spec["overlong_penalty"]

    def overlong(length: int) -> float:  # mcore_rl/rewards/overlong.py's shaping, restated
        start = limit - buffer
        return 0.0 if not buffer or length <= start else -min(length - start, buffer) / buffer * factor

    def reward(completions, ground_truth, data_source, completion_ids, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [
            task_reward.score(t, g, d) + overlong(len(ids))
            for t, g, d, ids in zip(texts, ground_truth, data_source, completion_ids)
        ]

    mini = spec["mini_batches"]

    class Report(TrainerCallback):
        """The Trainer logs right after each optimizer step (logging_steps=1); a batch's reward is logged at its
        first optimizer step (when it was generated), the step line at its last."""

        def __init__(self):
            self.reward = None

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs and math.isfinite(float(logs["reward"])):
                self.reward = float(logs["reward"])
            if state.global_step % mini == 0 and self.reward is not None:
                print(f"STEP {state.global_step // mini} {self.reward:.6f} {time.time():.6f}", flush=True)
                self.reward = None

    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    config = GRPOConfig(output_dir=spec["out_dir"], **trl_settings(spec))
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tokenizer)
    trainer.add_callback(Report())
    effective = trl_effective(trainer, model)
    print("SETTINGS " + json.dumps(effective), flush=True)
    if effective["gradient_checkpointing"] or effective["aux_loss_enabled"]:
        raise SystemExit(f"the TRL baseline must run without gradient checkpointing and auxiliary loss: {effective}")
    trainer.train()


def trl_settings(spec: dict) -> dict:
    """GRPOConfig's arguments (but output_dir) for the demo's task, as TRL's users would set them for a 260k-parameter
    model and with mcore-rl's objective; the launcher prints every one."""
    a, mini = spec["algo"], spec["mini_batches"]
    return dict(
        use_cpu=True,
        seed=spec["seed"],
        max_steps=spec["max_steps"] * mini,
        per_device_train_batch_size=spec["prompts"] * spec["n"] // mini,
        num_generations=spec["n"],
        gradient_accumulation_steps=1,
        steps_per_generation=mini,
        num_iterations=1,
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=spec["weight_decay"],
        adam_beta1=spec["adam_beta1"],
        adam_beta2=spec["adam_beta2"],
        adam_epsilon=spec["adam_eps"],
        max_grad_norm=spec["clip_grad"],
        beta=0.0,
        epsilon=a["clip_low"],
        epsilon_high=a["clip_high"],
        importance_sampling_level="sequence" if a["loss"] == "gspo" else "token",
        loss_type="grpo",  # per-sequence token mean, then the batch mean (seq-mean-token-mean)
        scale_rewards="group",  # (R - group mean) / group std, like adv_estimator=grpo
        # TRL 1.16's GRPOConfig turns it on by default (trl/trainer/base_config.py); nothing to save on a tiny model
        gradient_checkpointing=False,
        # mbridge builds Qwen3-MoE with moe_router_load_balancing_type "none", so mcore-rl's loss has no load-balancing
        # term; unset, TRL 1.16 takes the model config's router_aux_loss_coef (0.001 in the tiny models) and adds it
        router_aux_loss_coef=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def trl_effective(trainer, model) -> dict:
    """What the TRL run does, read back from the trainer and model it built (and the versions)."""
    import torch
    import transformers
    import trl

    return {
        "gradient_checkpointing": bool(trainer.args.gradient_checkpointing or model.is_gradient_checkpointing),
        "aux_loss_enabled": bool(trainer.aux_loss_enabled),
        "router_aux_loss_coef": trainer.router_aux_loss_coef,
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }


# ---- the launcher (runs in mcore-rl's venv) -----------------------------------------------------------------
def _load() -> float:
    return os.getloadavg()[0]


@dataclass(frozen=True)
class Goal:
    """Where a run stops: a `window`-step mean reward of `threshold`, or the end of step `steps` when set."""

    threshold: float
    window: int
    steps: Optional[int] = None

    def reached(self, steps: list[tuple[int, float, float]]) -> bool:
        """steps: (step, mean reward, unix time at the step's end), in order."""
        if self.steps is not None:
            return bool(steps) and steps[-1][0] >= self.steps
        rewards = [r for _, r, _ in steps[-self.window :]]
        return len(rewards) == self.window and sum(rewards) / self.window >= self.threshold

    def describe(self) -> str:
        return (
            f"the end of step {self.steps}" if self.steps else f"a {self.window}-step mean reward of {self.threshold}"
        )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _summary(name: str, launched: float, steps: list[tuple[int, float, float]], goal: Goal) -> dict:
    """steps: (step, mean reward, unix time at the step's end), in order."""
    hit = next((i for i in range(len(steps)) if goal.reached(steps[: i + 1])), None)
    upto = steps[: (hit + 1) if hit is not None else len(steps)]
    durations = [b[2] - a[2] for a, b in zip(upto, upto[1:])]
    median = statistics.median(durations) if durations else float("nan")
    first_end = upto[0][2] - launched if upto else float("nan")
    rewards = [r for _, r, _ in upto]
    return {
        "name": name,
        "reached": hit is not None,
        "step": upto[-1][0] if upto else None,
        "wall_s": (upto[-1][2] - launched) if upto else float("nan"),
        "median_step_s": median,
        "startup_s": first_end - median,
        "steps_run": len(steps),
        "reward_first": _mean(rewards[: goal.window]),
        "reward_last": _mean(rewards[-goal.window :]),
    }


def _stop(proc: subprocess.Popen) -> None:
    import psutil

    try:
        family = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(family[1:], timeout=30)


def run_trl(spec: dict, goal: Goal, python: Path) -> dict:
    if not python.is_file():
        raise SystemExit(
            f"{python} not found: run `make setup-trl` first (TRL in its own venv), or give --trl-python PATH"
        )
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false")
    launched = time.time()
    proc = subprocess.Popen(
        [str(python), __file__, "--trl-worker", json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO,
    )
    steps, tail, effective = [], [], {}
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        if line.startswith("SETTINGS "):
            effective = json.loads(line[len("SETTINGS ") :])
            print(f"TRL as run: {_settings_text(effective)}", flush=True)
        if line.startswith("STEP "):
            _, step, reward, stamp = line.split()
            steps.append((int(step), float(reward), float(stamp)))
            if goal.reached(steps):
                break
    _stop(proc)
    if not steps:
        raise SystemExit("TRL run produced no steps:\n" + "".join(tail))
    return dict(_summary("trl", launched, steps, goal), settings=effective)


def _settings_text(settings: dict) -> str:
    return ", ".join(f"{key}={value}" for key, value in settings.items())


def run_mcore(preset: str, overrides: list[str], run_dir: Path, goal: Goal, repo: Path = REPO) -> dict:
    metrics = run_dir / "metrics.jsonl"
    cmd = [sys.executable, "-m", "mcore_rl.cli", "train", preset, f"trainer.run_dir={run_dir}", *overrides]
    launched = time.time()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=repo,  # `python -m mcore_rl.cli` imports the package of the working directory first
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        start_new_session=True,
    )
    steps: list[tuple[int, float, float]] = []
    seen = 0
    while True:
        done = proc.poll() is not None
        if metrics.is_file():
            # only whole lines: the trainer may be writing the last one as it is read
            lines = [line for line in metrics.read_text().splitlines(keepends=True) if line.endswith("\n")]
            for line in lines[seen:]:
                if line.strip():
                    row = json.loads(line)
                    if "reward/mean" in row:
                        steps.append((row["step"], row["reward/mean"], row["time"]))
            seen = len(lines)
        if goal.reached(steps) or done:
            break
        time.sleep(0.05)
    err = proc.stderr.read() if done else ""
    _stop(proc)
    if done and proc.returncode and not steps:
        raise SystemExit(f"mcore-rl train failed ({proc.returncode}):\n{err[-4000:]}")
    return _summary("mcore-rl", launched, steps, goal)


def trl_spec(cfg, seed: int, out_dir: str, max_steps: int, threads: int) -> dict:
    if cfg.algo.kl_coef or cfg.algo.entropy_coef or cfg.algo.loss not in ("gspo", "grpo"):
        raise SystemExit("the TRL baseline covers the tiny GSPO / GRPO presets without KL or entropy bonus")
    if cfg.algo.ppo_epochs != 1 or cfg.algo.dynamic_sampling:
        raise SystemExit("the TRL baseline covers one pass over each batch (algo.ppo_epochs = 1, no dynamic sampling)")
    o = cfg.actor.optim
    return dict(
        model_path=str(Path(cfg.model.path).resolve()),
        train_path=str(Path(cfg.data.train_path).resolve()),
        out_dir=out_dir,
        seed=seed,
        max_steps=max_steps,
        prompts=cfg.data.prompts_per_step,
        n=cfg.rollout.n,
        mini_batches=cfg.algo.mini_batches,
        max_new_tokens=cfg.rollout.max_new_tokens,
        overlong_buffer=cfg.reward.overlong_buffer,
        overlong_penalty=cfg.reward.overlong_penalty,
        temperature=cfg.rollout.temperature,
        lr=o.lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        algo={"loss": cfg.algo.loss, "clip_low": cfg.algo.clip_low, "clip_high": cfg.algo.clip_high},
        threads=threads,
    )


def _line(r: dict, before: float, after: float, goal: Goal) -> str:
    status = f"reached at step {r['step']}" if r["reached"] else f"NOT reached in {r['steps_run']} steps"
    return (
        f"{r['name']:9s} {status}: {r['wall_s']:.1f} s from launch, median {r['median_step_s']:.3f} s/step, "
        f"start-up {r['startup_s']:.1f} s, mean reward first / last {goal.window} steps "
        f"{r['reward_first']:.3f} / {r['reward_last']:.3f} (load {before:.1f} -> {after:.1f})"
    )


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f}x, spread {min(values):.2f}x - {max(values):.2f}x"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--trl-worker":
        trl_worker(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="configs/tiny/gspo_cpu.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="trainer.seed of each pair of runs")
    parser.add_argument("--only", choices=["mcore", "trl"], default=None)
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument(
        "--steps", type=int, default=None, help="compare the wall time to the end of this step instead of the threshold"
    )
    parser.add_argument(
        "--trl-threads",
        type=int,
        default=None,
        help="torch threads of the TRL process (default: trainer.nproc, the cores mcore-rl's single-threaded ranks use)",
    )
    parser.add_argument(
        "--trl-python",
        default=str(TRL_PYTHON),
        help="python of TRL's venv (default: $MCORE_RL_TRL_PYTHON or .venv-trl)",
    )
    parser.add_argument(
        "--mcore-repo",
        default=str(REPO),
        help="source tree whose mcore_rl runs (e.g. an unpacked older commit, for a before/after pair)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides for the mcore-rl run")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from mcore_rl.config import load_config

    goal = Goal(args.threshold, args.window, args.steps)
    max_steps = max(args.max_steps, args.steps or 0)
    results, ratios, step_ratios = [], [], []
    with tempfile.TemporaryDirectory(prefix="demo_speed_") as tmp:
        for seed in args.seeds:
            overrides = [f"trainer.seed={seed}", f"trainer.steps={max_steps}", *args.overrides]
            cfg = load_config(REPO / args.preset, overrides)
            pair = {}
            if args.only != "trl":
                before = _load()
                run_dir = Path(tmp) / f"mcore_{seed}"
                print(f"mcore-rl train {args.preset} {' '.join(overrides)}", flush=True)
                pair["mcore"] = run_mcore(args.preset, overrides, run_dir, goal, Path(args.mcore_repo).resolve())
                print(_line(pair["mcore"], before, _load(), goal), flush=True)
            if args.only != "mcore":
                before = _load()
                threads = args.trl_threads or cfg.trainer.nproc
                spec = trl_spec(cfg, seed, str(Path(tmp) / f"trl_{seed}"), max_steps, threads)
                print(f"TRL GRPOConfig: {_settings_text(trl_settings(spec))}; torch threads {threads}", flush=True)
                pair["trl"] = run_trl(spec, goal, Path(args.trl_python))
                print(_line(pair["trl"], before, _load(), goal), flush=True)
            if len(pair) == 2:
                ratios.append(pair["mcore"]["wall_s"] / pair["trl"]["wall_s"])
                step_ratios.append(pair["mcore"]["median_step_s"] / pair["trl"]["median_step_s"])
                print(
                    f"seed {seed}: mcore-rl / TRL wall time to {goal.describe()}: {ratios[-1]:.2f}x "
                    f"(median s/step {step_ratios[-1]:.2f}x)",
                    flush=True,
                )
            results.append({"seed": seed, **pair})
    if ratios:
        print(
            f"{args.preset}, seeds {' '.join(map(str, args.seeds))}: mcore-rl / TRL wall time to {goal.describe()}: "
            f"{' '.join(f'{r:.2f}x' for r in ratios)} ({_spread(ratios)}); median s/step {_spread(step_ratios)}",
            flush=True,
        )
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
