"""A supervised warm start of the tiny checkpoint on a multi-token task (`mcore-rl make-tiny --warm-start KIND`).

RL from a randomly initialised model cannot find the end of turn (benchmarks/task_learnability.py): it emits
<|im_end|> with probability ~1/128 a token. A real RL run starts from an instruct model that already answers
in the format; this gives the demo such a policy. A few hundred plain-torch steps of cross-entropy on the
answer and its <|im_end|> (the prompt is context, not target), on prompts from their own seed (not the
task's train or validation rows), stopping at the first evaluation whose sampled (temperature 1, as RL samples) reward on held-out
prompts reaches `target_low`: the model then answers in the format and is right on some prompts, leaving RL the rest.
Deterministic per seed on one machine and thread count (sampling is seeded).
Written as a normal Hugging Face checkpoint (the class of `arch`, the project's tokenizer).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

from mcore_rl.data.task import MULTI_TOKEN_KINDS, TaskSpec, default_length, make_rows
from mcore_rl.models.tiny import TinyModelShape, build_tokenizer, make_tiny_checkpoint
from mcore_rl.rewards.task import score

_TRAIN_SEED_OFFSET = 2_000_003  # the task's rows use seed and seed + 1_000_003
_EVAL_SEED_OFFSET = 3_000_017


@dataclass(frozen=True)
class WarmStartSpec:
    max_steps: int = 600  # supervised steps at most
    batch_size: int = 64
    lr: float = 1.0e-3
    eval_every: int = 10
    eval_prompts: int = 128
    target_low: float = 0.2  # stop at the first evaluation whose sampled (T=1) reward is at least this

    def __post_init__(self):
        if self.max_steps < 1 or self.batch_size < 1 or self.eval_every < 1 or self.eval_prompts < 1:
            raise ValueError(f"WarmStartSpec needs max_steps, batch_size, eval_every, eval_prompts >= 1: {self}")


def check_fits(task: TaskSpec, positions: int = TinyModelShape.max_position_embeddings) -> Optional[str]:
    """Why the longest prompt of `task`, its answer and <|im_end|> do not fit the tiny model's positions (None: they
    fit). The tokenizer is character-level: each symbol one token."""
    prompt = len(_chat_ids(build_tokenizer(), task.alphabet[0] * task.length))
    needed = prompt + task.length + 1
    if needed <= positions:
        return None
    longest = (positions - 1 - (prompt - task.length)) // 2
    return f"a prompt, answer and <|im_end|> of {needed} tokens exceed the tiny model's {positions} positions: {longest} at most"


def _chat_ids(tokenizer, content: str) -> list[int]:
    messages = [{"role": "user", "content": content}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def _sft_batch(tokenizer, rows: list[dict]):
    """Right-padded inputs, with labels on the answer and its <|im_end|> only."""
    import torch

    seqs, targets = [], []
    for row in rows:
        prompt = _chat_ids(tokenizer, row["prompt"][0]["content"])
        answer = tokenizer.encode(row["reward_model"]["ground_truth"], add_special_tokens=False)
        answer.append(tokenizer.eos_token_id)
        seqs.append(prompt + answer)
        targets.append([-100] * len(prompt) + answer)
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    labels = torch.tensor([t + [-100] * (width - len(t)) for t in targets])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    return ids, mask, labels


def evaluate(model, tokenizer, rows: list[dict], max_new_tokens: int, sample_seed: Optional[int] = None) -> dict:
    """Mean task reward over `rows`: greedy, or sampled at temperature 1 with `sample_seed`; with the fraction of
    responses that end with <|im_end|> within max_new_tokens. Texts decoded as the trainer decodes them."""
    import torch

    prompts = [_chat_ids(tokenizer, r["prompt"][0]["content"]) for r in rows]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left-padded for generation
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(do_sample=False) if sample_seed is None else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    if sample_seed is not None:
        torch.manual_seed(sample_seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad,
            **kwargs,
        )
    responses = out[:, width:].tolist()
    ended = [tokenizer.eos_token_id in r for r in responses]
    cut = [r[: r.index(tokenizer.eos_token_id) + 1] if e else r for r, e in zip(responses, ended)]
    texts = tokenizer.batch_decode(cut, skip_special_tokens=True)
    rewards = [score(t, r["reward_model"]["ground_truth"], r["data_source"]) for t, r in zip(texts, rows)]
    n = len(rows)
    return {"reward": sum(rewards) / n, "exact": sum(r == 1.0 for r in rewards) / n, "ended": sum(ended) / n}


def warm_start(
    out_dir: str | os.PathLike,
    kind: str = "reverse",
    seed: int = 0,
    arch: str = "qwen3-moe",
    spec: WarmStartSpec = WarmStartSpec(),
    log: Callable[[str], None] = lambda _: None,
    length: Optional[int] = None,
    min_length: int = TaskSpec.min_length,
) -> Path:
    """Write the tiny `arch` checkpoint of `seed`, trained with supervised steps on `kind` (prompts of
    `min_length`..`length` symbols, the task's default length when None), to out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if kind not in MULTI_TOKEN_KINDS:
        raise ValueError(f"--warm-start {kind!r}: choose one of {', '.join(MULTI_TOKEN_KINDS)}")
    task = TaskSpec(kind=kind, length=default_length(kind, length), min_length=min_length)
    out = make_tiny_checkpoint(out_dir, seed=seed, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    eval_rows = make_rows(spec.eval_prompts, seed + _EVAL_SEED_OFFSET, task)
    train_rows = make_rows(spec.max_steps * spec.batch_size, seed + _TRAIN_SEED_OFFSET, task)
    max_new = task.length + 4  # as the multi-token presets' rollout.max_new_tokens
    torch.manual_seed(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    start, step = time.perf_counter(), 0
    greedy = sampled = {"reward": 0.0, "exact": 0.0, "ended": 0.0}
    while step < spec.max_steps:
        model.train()
        ids, mask, labels = _sft_batch(tokenizer, train_rows[step * spec.batch_size : (step + 1) * spec.batch_size])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        step += 1
        if step % spec.eval_every == 0 or step == spec.max_steps:
            model.eval()
            greedy = evaluate(model, tokenizer, eval_rows, max_new)
            sampled = evaluate(model, tokenizer, eval_rows, max_new, sample_seed=seed)
            log(
                f"warm start step {step}: loss {loss.item():.3f}, reward sampled (T=1) {sampled['reward']:.3f} "
                f"(exact {sampled['exact']:.0%}, ends with <|im_end|> {sampled['ended']:.0%}), greedy "
                f"{greedy['reward']:.3f} (exact {greedy['exact']:.0%}) ({time.perf_counter() - start:.1f} s)"
            )
            if sampled["reward"] >= spec.target_low:
                break
    log(f"warm start done after {step} steps ({time.perf_counter() - start:.1f} s)")
    model.save_pretrained(out, safe_serialization=True)
    meta_path = out / "mcore_rl_tiny.json"
    meta = json.loads(meta_path.read_text())
    meta["warm_start"] = {
        "kind": kind,
        "task": asdict(task),
        "spec": asdict(spec),
        "steps": step,
        "greedy": greedy,
        "sampled": sampled,
        "seconds": round(time.perf_counter() - start, 1),
    }
    meta_path.write_text(json.dumps(meta, indent=2))
    return out
