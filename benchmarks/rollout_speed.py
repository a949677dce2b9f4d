"""CPU time of one rank's rollout on a preset's real batches: the embedded engine's generate, per part, against
transformers' own `generate` on the same batch, and the reward (detokenise + score, in-process and through
the reward worker).

    python benchmarks/rollout_speed.py [--preset configs/tiny/gspo_cpu.yaml] [--steps 10] [--threads 1] [--ranks N]

One process, `--threads` torch threads (the trainer's ranks run with 1). Each step takes the sampler's next
prompts as the trainer does and generates rank 0's share of `--ranks` (default trainer.nproc: data.prompts_per_step
/ nproc prompts x rollout.n; `--ranks 1 --threads 2` is the whole step in one process with 2 threads, as TRL's
GRPOTrainer generates it) with the trainer's seeds. Printed: CPU seconds per step (time.process_time, the median
over the steps after a warm-up one) of the whole generate, of the model's forwards (prefill and decode steps),
of the sampling; the same batch through `model.generate` (sampling, the same stop tokens and max_new_tokens);
and the reward's parts: detokenising, scoring in this process (what the trainer does for reward.fn=task), and
the same function in a RewardWorker process (what it does for other rewards with reward.timeout_s > 0), whose
first batch also starts the worker (printed apart: wall seconds and the worker's CPU).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def _cpu(acc: dict, key: str):
    start = time.process_time()
    try:
        yield
    finally:
        acc[key] += time.process_time() - start


def _instrument(engine, acc: dict) -> None:
    """Time the engine's forwards (prefill vs decode) and its sampling step in place."""
    forward, pick = engine._forward, engine._pick

    def timed_forward(ids, *args, **kwargs):
        with _cpu(acc, "forward: prefill" if ids.shape[1] > 1 else "forward: decode steps"):
            out = forward(ids, *args, **kwargs)
        if ids.shape[1] == 1:
            acc["decode steps (count)"] += 1
        return out

    def timed_pick(*args, **kwargs):
        with _cpu(acc, "sampling (_pick)"):
            return pick(*args, **kwargs)

    engine._forward, engine._pick = timed_forward, timed_pick


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="configs/tiny/gspo_cpu.yaml")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ranks", type=int, default=None, help="share of rank 0 of this many (default trainer.nproc)")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import torch
    from transformers import AutoTokenizer

    from mcore_rl.config import load_config
    from mcore_rl.data.dataset import EpochSampler, load_prompt_dataset
    from mcore_rl.rewards import RewardScorer
    from mcore_rl.rewards.registry import BUILTIN_REWARDS
    from mcore_rl.rollout import sampling_params
    from mcore_rl.rollout.data_parallel import share
    from mcore_rl.rollout.embedded import EmbeddedEngine

    torch.set_num_threads(args.threads)
    cfg = load_config(args.preset, [])
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    data = load_prompt_dataset(cfg.data.train_path, tokenizer, cfg.data.max_prompt_len, cfg.data.prompt_key)
    sampler = EpochSampler(len(data), cfg.data.prompts_per_step, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    engine = EmbeddedEngine(cfg.model.path, dtype=cfg.model.dtype, return_routed_experts=False)
    reward = (cfg.reward.fn, cfg.rollout.max_new_tokens, cfg.reward.overlong_buffer, cfg.reward.overlong_penalty)
    in_process = RewardScorer(*reward, timeout_s=0)
    # the same function by its module path, which always takes a worker with timeout_s > 0
    worker = RewardScorer(BUILTIN_REWARDS.get(cfg.reward.fn, cfg.reward.fn), *reward[1:], timeout_s=300)
    stop = [tokenizer.eos_token_id]
    mine = share(cfg.data.prompts_per_step, 0, args.ranks or cfg.trainer.nproc)
    rows: list[dict] = []
    acc: dict = defaultdict(float)
    _instrument(engine, acc)
    for step in range(args.steps + 1):
        examples = [data[i] for i in sampler.next_batch()][mine.start : mine.stop]
        prompts = [ex.prompt_ids for ex in examples]
        params = sampling_params(cfg.rollout, stop_token_ids=stop)
        params.seed = cfg.trainer.seed * 1_000_003 + step * 7919 + mine.start
        acc.clear()
        with _cpu(acc, "generate (whole)"):
            groups = engine.generate(prompts, cfg.rollout.n, params)
        samples = [s for g in groups for s in g]
        acc["response tokens (count)"] = sum(len(s.response_ids) for s in samples)
        if not args.no_hf:
            acc.update(_hf_generate(engine, tokenizer, prompts, cfg.rollout.n, params, step))
        with _cpu(acc, "reward: batch_decode"):
            texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        truths = [ex.ground_truth for ex in examples for _ in range(cfg.rollout.n)]
        sources = [ex.data_source for ex in examples for _ in range(cfg.rollout.n)]
        extras = [ex.extra_info for ex in examples for _ in range(cfg.rollout.n)]
        lengths = [len(s.response_ids) for s in samples]
        with _cpu(acc, "reward: score in-process"):
            a = in_process(texts, truths, sources, extras, lengths)
        start = time.perf_counter()
        with _cpu(acc, "reward: score via worker (this process)"):
            b = worker(texts, truths, sources, extras, lengths)
        acc["reward: score via worker (wall)"] += time.perf_counter() - start
        assert a.rewards == b.rewards
        if step == 0:  # step 0 warms up and starts the reward worker
            first_batch = acc["reward: score via worker (wall)"]
        else:
            rows.append(dict(acc))
    worker.close()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(
        f"reward worker start + first batch: {first_batch:.3f} s wall; the worker's CPU over the run "
        f"(with multiprocessing's resource tracker): {children.ru_utime + children.ru_stime:.3f} s"
    )
    print(
        f"{args.preset}: {len(prompts)} prompts x {cfg.rollout.n}, {args.threads} thread(s), medians over {len(rows)} steps"
    )
    for key in rows[0]:
        values = [r.get(key, 0.0) for r in rows]
        unit = "" if "(count)" in key else " s"
        print(f"  {key:44s} {statistics.median(values):9.4f}{unit}")


def _hf_generate(engine, tokenizer, prompts, n, params, step) -> dict:
    """transformers' generate on the same left-padded batch (as TRL's GRPOTrainer calls it)."""
    import torch

    expanded = [p for p in prompts for _ in range(n)]
    width = max(len(p) for p in expanded)
    ids = torch.full((len(expanded), width), engine.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(expanded):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    torch.manual_seed(step)
    start = time.process_time()
    out = engine.model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=params.temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=params.max_new_tokens,
        eos_token_id=params.stop_token_ids,
        pad_token_id=engine.pad_token_id,
    )
    return {
        "HF generate, same batch": time.process_time() - start,
        "HF generate tokens/row (count)": out.shape[1] - width,
    }


if __name__ == "__main__":
    main()
