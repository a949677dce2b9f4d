"""The embedded task: a prompt dataset a tiny, randomly initialised model can learn from scratch with RL.

Two kinds, both with the answer in the prompt (learned through attention, not memorised; single-digit
addition from scratch barely moved in 1,000 steps here):
- "majority" (default): the prompt is a string of 16 digits in which one digit fills 12 places; the
  answer is that digit. User "3733193338334353" -> assistant "3<|im_end|>". The more often the answer
  appears, the stronger its trace in a random model's attention average, and the sooner RL finds it:
  12 of 16 reached 0.8 reward in 83-139 steps of 8 prompts x 16 samples (benchmarks/task_learnability.py);
  3 of 5 stalled near 0.3-0.6 after 300 steps of 64 samples.
- "copy_kth": the prompt is a position k and a string; the answer is the k-th symbol (1-based).
  User "3 of 7294" -> assistant "9<|im_end|>".
- "reverse" (multi-token answers): the prompt is a string of min_length..length symbols (2..12 by default,
  uniform per prompt); the answer is that string reversed, so answers vary in length and must end with
  <|im_end|>. User "4821" -> assistant "1284<|im_end|>". Scored with partial credit
  (`mcore_rl.rewards.task.score_reverse`); a random model cannot find the end of turn, so RL on it starts from
  a supervised warm start (`mcore-rl make-tiny --warm-start reverse`, mcore_rl/models/warm_start.py).
A model that answers with a random symbol of the alphabet scores 1/len(alphabet); a randomly initialised
model starts near 1/128 (uniform over the vocabulary), see `chance_reward`.

Rows use verl's layout: `prompt` (list of chat messages), `reward_model.ground_truth`, `data_source`,
`extra_info`. The reward is `mcore_rl.rewards.task.score` (reward.fn "task"): all-or-nothing on the symbol,
partial credit for "reverse" (it picks the scorer by the row's data_source).
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

TASK_KINDS = ("majority", "copy_kth", "reverse")
MULTI_TOKEN_KINDS = ("reverse",)  # answers of several tokens; their default length is 12


@dataclass(frozen=True)
class TaskSpec:
    kind: str = "majority"
    length: int = 16  # symbols shown per prompt
    alphabet: str = "0123456789"  # symbols the prompt is drawn from
    fixed_k: int = 0  # copy_kth: 0 draws k from 1..length per prompt; > 0 always uses this position
    count: int = 12  # majority: how often the answer appears (a strict majority); 0 -> length // 2 + 1
    min_length: int = 2  # reverse: the prompt's length is drawn from min_length..length

    def __post_init__(self):
        if self.kind not in TASK_KINDS:
            raise ValueError(f"TaskSpec.kind={self.kind!r}; choose one of {', '.join(TASK_KINDS)}")
        if self.length < 1 or len(set(self.alphabet)) != len(self.alphabet) or len(self.alphabet) < 2:
            raise ValueError(
                f"TaskSpec needs length >= 1 and an alphabet of >= 2 distinct symbols, "
                f"got length={self.length}, alphabet={self.alphabet!r}"
            )
        if self.kind == "majority" and self.count and not self.length // 2 < self.count <= self.length:
            raise ValueError(
                f"TaskSpec.count={self.count} must be a strict majority of length={self.length} "
                f"(in {self.length // 2 + 1}..{self.length}) or 0"
            )
        if self.kind == "reverse" and not 1 <= self.min_length <= self.length:
            raise ValueError(f"TaskSpec.min_length={self.min_length} must be in 1..length={self.length}")
        if not 0 <= self.fixed_k <= self.length:
            raise ValueError(f"TaskSpec.fixed_k={self.fixed_k} must be 0 (random) or in 1..length={self.length}")

    @property
    def data_source(self) -> str:
        return f"mcore_rl/{self.kind}"


def default_length(kind: str, length: Optional[int] = None) -> int:
    """The prompt length of `kind` when none is given: 12 symbols for the multi-token kinds, else 16."""
    if length is not None:
        return length
    return 12 if kind in MULTI_TOKEN_KINDS else TaskSpec.length


def chance_reward(spec: TaskSpec = TaskSpec(), vocab_size: int = 128) -> dict[str, float]:
    """Expected reward of guessing uniformly over the vocabulary (a random model) and over the alphabet."""
    return {"uniform_over_vocab": 1.0 / vocab_size, "uniform_over_alphabet": 1.0 / len(spec.alphabet)}


def _majority(rng: random.Random, spec: TaskSpec) -> tuple[str, str, dict]:
    answer = rng.choice(spec.alphabet)
    others = [c for c in spec.alphabet if c != answer]
    count = spec.count or spec.length // 2 + 1  # a strict majority, so the answer is unique
    symbols = [answer] * count + [rng.choice(others) for _ in range(spec.length - count)]
    rng.shuffle(symbols)
    text = "".join(symbols)
    return text, answer, {"symbols": text}


def _copy_kth(rng: random.Random, spec: TaskSpec) -> tuple[str, str, dict]:
    symbols = "".join(rng.choice(spec.alphabet) for _ in range(spec.length))
    k = spec.fixed_k or rng.randint(1, spec.length)
    return f"{k} of {symbols}", symbols[k - 1], {"k": k, "symbols": symbols}


def _reverse(rng: random.Random, spec: TaskSpec) -> tuple[str, str, dict]:
    symbols = "".join(rng.choice(spec.alphabet) for _ in range(rng.randint(spec.min_length, spec.length)))
    return symbols, symbols[::-1], {"symbols": symbols}


_MAKERS = {"majority": _majority, "copy_kth": _copy_kth, "reverse": _reverse}


def make_example(rng: random.Random, spec: TaskSpec = TaskSpec()) -> dict:
    """One row in verl's layout."""
    content, answer, extra = _MAKERS[spec.kind](rng, spec)
    return {
        "prompt": [{"role": "user", "content": content}],
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "data_source": spec.data_source,
        "extra_info": extra,
    }


def make_rows(n: int, seed: int, spec: TaskSpec = TaskSpec()) -> list[dict]:
    rng = random.Random(seed)
    return [make_example(rng, spec) for _ in range(n)]


def write_rows(rows: list[dict], path: Path) -> Path:
    """Parquet for .parquet, JSON lines for .jsonl."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        raise ValueError(f"cannot write {path}: use a .parquet or .jsonl file name")
    return path


def make_task_dataset(
    out_dir,
    train_size: int = 4096,
    val_size: int = 256,
    seed: int = 0,
    spec: TaskSpec = TaskSpec(),
    fmt: str = "parquet",
) -> tuple[Path, Path]:
    """Write train.<fmt>, val.<fmt> and task.json to out_dir; train and validation use different seeds."""
    if train_size < 1 or val_size < 1:
        raise ValueError(f"make_task_dataset needs train_size >= 1 and val_size >= 1, got {train_size}, {val_size}")
    if fmt not in ("parquet", "jsonl"):
        raise ValueError(f"make_task_dataset: fmt={fmt!r}; choose 'parquet' or 'jsonl'")
    out = Path(out_dir)
    train = write_rows(make_rows(train_size, seed, spec), out / f"train.{fmt}")
    val = write_rows(make_rows(val_size, seed + 1_000_003, spec), out / f"val.{fmt}")
    (out / "task.json").write_text(
        json.dumps(
            {
                "data_source": spec.data_source,
                "spec": asdict(spec),
                "seed": seed,
                "train_size": train_size,
                "val_size": val_size,
                "chance_reward": chance_reward(spec),
            },
            indent=2,
        )
    )
    return train, val


def main(argv=None) -> tuple[Path, Path]:
    """`python -m mcore_rl.data.task OUT_DIR` (the backend of `mcore-rl make-task`)."""
    p = argparse.ArgumentParser(description="Write the embedded task's train/validation sets (verl layout).")
    p.add_argument("out_dir")
    p.add_argument("--train-size", type=int, default=4096)
    p.add_argument("--val-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kind", default=TaskSpec.kind, choices=TASK_KINDS)
    p.add_argument("--length", type=int, default=None, help="default: 12 for reverse, 16 otherwise")
    p.add_argument("--min-length", type=int, default=TaskSpec.min_length, help="reverse: shortest prompt")
    p.add_argument("--count", type=int, default=TaskSpec.count, help="majority: times the answer appears")
    p.add_argument("--alphabet", default=TaskSpec.alphabet)
    p.add_argument("--format", default="parquet", choices=("parquet", "jsonl"))
    a = p.parse_args(argv)
    spec = TaskSpec(
        kind=a.kind,
        length=default_length(a.kind, a.length),
        alphabet=a.alphabet,
        count=a.count,
        min_length=a.min_length,
    )
    train, val = make_task_dataset(a.out_dir, a.train_size, a.val_size, a.seed, spec, a.format)
    print(f"wrote {train} ({a.train_size} rows) and {val} ({a.val_size} rows); chance reward {chance_reward(spec)}")
    return train, val


if __name__ == "__main__":
    main()
