"""The embedded task: files in verl's layout that load, answers that are right, a reward that agrees."""

import collections
import json
import random

import pytest

from mcore_rl.data import TaskSpec, chance_reward, load_prompt_dataset, make_task_dataset
from mcore_rl.data.task import main as make_task_main
from mcore_rl.data.task import make_rows
from mcore_rl.models.tiny import build_tokenizer
from mcore_rl.rewards import RewardScorer


def independent_answer(row) -> str:
    content = row["prompt"][0]["content"]
    if row["data_source"] == "mcore_rl/majority":
        symbol, count = collections.Counter(content).most_common(1)[0]
        assert count > len(content) / 2
        return symbol
    if row["data_source"] == "mcore_rl/reverse":
        return "".join(content[i] for i in range(len(content) - 1, -1, -1))
    k, _, symbols = content.partition(" of ")
    return symbols[int(k) - 1]


@pytest.mark.parametrize(
    "spec",
    [
        TaskSpec(),
        TaskSpec(kind="majority", length=16, count=12),
        TaskSpec(kind="copy_kth", length=4),
        TaskSpec(kind="copy_kth", length=4, fixed_k=2),
        TaskSpec(kind="reverse", length=12),
    ],
)
def test_ground_truth_is_the_answer_found_in_the_prompt(spec):
    rows = make_rows(300, seed=5, spec=spec)
    assert all(r["reward_model"]["ground_truth"] == independent_answer(r) for r in rows)
    assert all(set(r["prompt"][0]["content"]) <= set(spec.alphabet + " of123456789") for r in rows)
    answers = collections.Counter(c for r in rows for c in r["reward_model"]["ground_truth"])
    assert set(answers) == set(spec.alphabet)  # every symbol occurs in an answer
    if spec.fixed_k:
        assert {r["extra_info"]["k"] for r in rows} == {spec.fixed_k}


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_make_task_dataset_files_load_and_score(tmp_path, fmt):
    tok = build_tokenizer()
    train, val = make_task_dataset(tmp_path, train_size=64, val_size=16, seed=3, fmt=fmt)
    assert (train.name, val.name) == (f"train.{fmt}", f"val.{fmt}")
    ds_train = load_prompt_dataset(train, tok, max_prompt_len=64)
    ds_val = load_prompt_dataset(val, tok, max_prompt_len=64)
    assert (len(ds_train), len(ds_val)) == (64, 16)
    assert ds_train.summary.malformed == 0 and ds_train.summary.too_long == 0
    assert {e.raw_prompt[0]["content"] for e in ds_train} != {e.raw_prompt[0]["content"] for e in ds_val}
    meta = json.loads((tmp_path / "task.json").read_text())
    assert meta["chance_reward"]["uniform_over_alphabet"] == pytest.approx(0.1)

    scorer = RewardScorer("task", max_new_tokens=4)
    truths = [e.ground_truth for e in ds_train]
    sources = [e.data_source for e in ds_train]
    right = scorer([t + "<|im_end|>" for t in truths], truths, sources)
    wrong = scorer([str((int(t) + 1) % 10) + "<|im_end|>" for t in truths], truths, sources)
    assert right.rewards == [1.0] * 64 and wrong.rewards == [0.0] * 64 and right.errors == 0


def test_same_seed_same_files_different_seed_different(tmp_path):
    a = make_task_dataset(tmp_path / "a", 32, 8, seed=1, fmt="jsonl")[0].read_text()
    b = make_task_dataset(tmp_path / "b", 32, 8, seed=1, fmt="jsonl")[0].read_text()
    c = make_task_dataset(tmp_path / "c", 32, 8, seed=2, fmt="jsonl")[0].read_text()
    assert a == b and a != c


def test_guessing_scores_the_stated_chance_level():
    spec = TaskSpec()
    rows = make_rows(4000, seed=9, spec=spec)
    rng = random.Random(0)
    guesses = [rng.choice(spec.alphabet) for _ in rows]
    out = RewardScorer("task", max_new_tokens=1)(
        guesses, [r["reward_model"]["ground_truth"] for r in rows], [r["data_source"] for r in rows]
    )
    mean = sum(out.rewards) / len(rows)
    assert abs(mean - chance_reward(spec)["uniform_over_alphabet"]) < 0.02


def test_cli_backend_writes_both_files(tmp_path, capsys):
    train, val = make_task_main([str(tmp_path), "--train-size", "10", "--val-size", "5", "--format", "jsonl"])
    assert len(train.read_text().splitlines()) == 10 and len(val.read_text().splitlines()) == 5
    assert "chance reward" in capsys.readouterr().out


def test_reverse_answers_vary_in_length_and_fit_the_multi_token_presets():
    rows = make_rows(500, seed=2, spec=TaskSpec(kind="reverse", length=12))
    lengths = collections.Counter(len(r["reward_model"]["ground_truth"]) for r in rows)
    assert set(lengths) == set(range(2, 13))  # every length 2..12 occurs
    tok = build_tokenizer()
    # one token a symbol: the longest answer + <|im_end|> is 13 tokens, under the presets' max_new_tokens = 16
    assert all(len(tok.encode(r["reward_model"]["ground_truth"], add_special_tokens=False)) <= 12 for r in rows)


def test_cli_backend_writes_the_reverse_kind(tmp_path):
    train, _ = make_task_main([str(tmp_path), "--kind", "reverse", "--train-size", "50", "--format", "jsonl"])
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert {r["data_source"] for r in rows} == {"mcore_rl/reverse"}
    assert max(len(r["prompt"][0]["content"]) for r in rows) <= 12
    assert json.loads((tmp_path / "task.json").read_text())["spec"]["length"] == 12


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kind="sum"), "choose one of majority, copy_kth"),
        (dict(length=5, count=2), "strict majority"),
        (dict(alphabet="11"), "distinct symbols"),
        (dict(kind="copy_kth", length=3, fixed_k=4), "fixed_k=4"),
        (dict(kind="reverse", length=4, min_length=5), "min_length=5"),
    ],
)
def test_bad_task_specs_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TaskSpec(**kwargs)


@pytest.mark.slow
def test_tiny_model_learns_the_task_from_scratch(tmp_path):
    """The learnability benchmark, cut short: reward starts near 1/128 and climbs well above 1/10 chance."""
    from benchmarks.task_learnability import main as learnability

    result = learnability(
        ["--steps", "120", "--target", "0.5", "--seed", "1", "--model-seed", "0", "--out", str(tmp_path / "curve.json")]
    )
    rewards = [c["reward"] for c in result["curve"]]
    assert sum(rewards[:10]) / 10 < 0.05
    assert result["reached_target_at_step"] is not None, rewards[-20:]
