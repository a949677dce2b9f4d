"""Peak memory and time of forward+backward for target log-probs + entropy over a large vocabulary:
our chunked path (`mcore_rl.megatron.logprobs.vocab_parallel_log_probs`, one process, no TP) against
the straightforward path (log_softmax over the full logits, gather, entropy from the full softmax),
in the same run, on CPU.

What is measured: from fp32 logits [tokens, vocab] that already exist (an input, like the output
layer's result in training) to the gradient w.r.t. those logits, for
loss = sum(g1 * log_prob) + sum(g2 * entropy) with random g1, g2 (so both gradients are exercised).
With --with-projection the timed region starts earlier, at hidden [tokens, hidden] and the output
weight [vocab, hidden]: logits = hidden @ W^T is then part of both paths (and their logits and
logits gradient count as extra memory for both), the gradient flows on to hidden and W (the
output-weight gradient counts in every path), and a third path runs: "fused"
(`fused_output_log_probs`), which never materialises the logits - the projection runs per chunk of
tokens and is recomputed in backward. Targets for it: extra peak <= 0.2x and time <= 1.35x of
the straightforward path.

How peak memory is measured on CPU: torch's CPU allocator has no peak statistics, and
tracemalloc does not see it. We set glibc's MALLOC_MMAP_THRESHOLD_ (the script re-executes itself
with it) so every large buffer is its own mmap that is returned to the OS when freed; the
resident-set high-water mark (VmHWM in /proc/self/status, reset by writing 5 to
/proc/self/clear_refs) is then the true peak of live tensor memory. "Extra peak" is that high-water
mark minus the resident size just before the pass (inputs already allocated), so it includes the
[tokens, vocab] gradient that every path must produce.

Run: OMP_NUM_THREADS=1 python benchmarks/logprob_memory.py [--with-projection] [--tokens 4096 --vocab 151936 --hidden 2048]
(the defaults are the specified size: Qwen3's vocabulary, 4,096 tokens, hidden 2,048 - ~15 GiB of RAM for the
straightforward path with --with-projection; the fused path is the one the actor runs)
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time

MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
if os.environ.get(MMAP_ENV) != "65536":  # must be set before the process starts: re-exec
    os.environ[MMAP_ENV] = "65536"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout

from mcore_rl.megatron.logprobs import LogProbOptions, fused_output_log_probs, vocab_parallel_log_probs  # noqa: E402

GIB = 1024**3


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


def reset_peak() -> int:
    """Reset the resident high-water mark; return current resident bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def peak_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def straightforward(logits, target, temperature):
    log_p = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
    log_prob = log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return log_prob, entropy


def ours(logits, target, temperature):
    return vocab_parallel_log_probs(logits, target, temperature, group=None, with_entropy=True)


def fused(hidden, weight, target, temperature):
    return fused_output_log_probs(hidden, weight, target, LogProbOptions(temperature, with_entropy=True))


def run_pass(path, inputs, g1, g2, target, temperature):
    """One timed forward+backward; returns (seconds, extra peak bytes, log_prob)."""
    for t in inputs:
        t.grad = None
    gc.collect()
    base = reset_peak()
    start = time.perf_counter()
    if path is fused:
        logits = None
        log_prob, entropy = fused(inputs[0], inputs[1], target, temperature)
    else:
        logits = inputs[0] @ inputs[1].t() if len(inputs) == 2 else inputs[0]
        log_prob, entropy = path(logits, target, temperature)
    ((log_prob * g1).sum() + (entropy * g2).sum()).backward()
    seconds = time.perf_counter() - start
    extra = peak_bytes() - base
    del logits, entropy
    return seconds, extra, log_prob.detach()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2, help="alternating passes per path; time = min, memory = max")
    ap.add_argument("--with-projection", action="store_true", help="include logits = hidden @ W^T in both paths")
    ap.add_argument(
        "--paths", default="", help="comma-separated subset of ours,straightforward,fused (default: all that apply)"
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    n, v = args.tokens, args.vocab
    if args.with_projection:
        hidden = (torch.randn(n, args.hidden) / args.hidden**0.5).requires_grad_(True)
        weight = torch.randn(v, args.hidden).requires_grad_(True)
        inputs = [hidden, weight]
    else:
        inputs = [(torch.randn(n, v) * 2).requires_grad_(True)]
    target = torch.randint(0, v, (n,))
    g1, g2 = torch.randn(n), torch.randn(n)
    print(
        f"tokens={n} vocab={v} hidden={args.hidden if args.with_projection else '-'} fp32, threads={torch.get_num_threads()}, "
        f"measured: {'hidden/weight -> logits -> ' if args.with_projection else 'logits -> '}log-prob + entropy, forward+backward"
    )
    print(f"one [tokens, vocab] fp32 buffer = {n * v * 4 / GIB:.2f} GiB")

    # warm-up at a small size so one-off allocations and kernel setup are not timed
    small = torch.randn(8, v, requires_grad=True)
    for path in (ours, straightforward):
        lp, h = path(small, target[:8], args.temperature)
        (lp.sum() + h.sum()).backward()
    paths = {"ours": ours, "straightforward": straightforward}
    if args.with_projection:
        paths["fused"] = fused
        w_small = torch.randn(64, args.hidden, requires_grad=True)
        lp, h = fused(torch.randn(8, args.hidden, requires_grad=True), w_small, target[:8] % 64, args.temperature)
        (lp.sum() + h.sum()).backward()
    if args.paths:
        paths = {k: paths[k] for k in args.paths.split(",")}

    results = {name: [] for name in paths}
    log_probs = {}
    for _ in range(args.repeats):
        for name, path in paths.items():
            seconds, extra, lp = run_pass(path, inputs, g1, g2, target, args.temperature)
            results[name].append((seconds, extra))
            log_probs[name] = lp
            print(f"  {name:16s} {seconds:7.2f} s   extra peak {extra / GIB:6.2f} GiB", flush=True)
    t = {k: min(s for s, _ in r) for k, r in results.items()}
    m = {k: max(b for _, b in r) for k, r in results.items()}
    for k in results:
        print(f"{k + ':':16s} time {t[k]:.2f} s, extra peak {m[k] / GIB:.2f} GiB")
    if "straightforward" not in results:
        return
    targets = {"ours": "(target <= 0.5 memory, <= 1.2 time)", "fused": "(target <= 0.2 memory, <= 1.35 time)"}
    for k in results:
        if k != "straightforward":
            diff = float((log_probs[k] - log_probs["straightforward"]).abs().max())
            print(
                f"ratios {k}/straightforward: memory {m[k] / m['straightforward']:.3f}, time "
                f"{t[k] / t['straightforward']:.3f} {targets[k]}; max |log_prob difference| = {diff:.2e}"
            )


if __name__ == "__main__":
    main()
