"""Rewards: task answer matching, math-verify, DAPO overlong penalty, selection and error counting."""

import os
import textwrap

import pytest

from mcore_rl.config import RewardConfig
from mcore_rl.rewards import OverlongPenalty, RewardScorer, resolve_reward_fn
from mcore_rl.rewards import math as math_reward
from mcore_rl.rewards import task as task_reward
from tests.torchrun_util import REPO


@pytest.mark.parametrize(
    "response,expected",
    [
        ("7<|im_end|>", 1.0),
        ("7", 1.0),
        (" 7\n<|im_end|>", 1.0),
        ("\n7 ", 1.0),
        ("8<|im_end|>", 0.0),
        ("77", 0.0),
        ("7x<|im_end|>", 0.0),
        ("", 0.0),
        ("<|im_end|>7", 0.0),
        ("7<|im_end|>garbage after the end", 1.0),
    ],
)
def test_task_reward_is_all_or_nothing_on_the_answer(response, expected):
    assert task_reward.score(response, "7", "mcore_rl/copy_kth", None) == expected


@pytest.mark.parametrize(
    "response,expected",
    [
        ("4321", 1.0),  # the engine stopped at <|im_end|>: the text is exactly the answer
        (" 4321\n", 1.0),
        ("4321<|im_end|>", 1.0),
        ("4320", 0.5 * 3 / 4),  # 3 of 4 symbols in place
        ("432", 0.5 * 3 / 4),  # stopped one early
        ("43211", 0.5 * 4 / 5),  # ran on one past the answer
        ("4321999999999999", 0.5 * 4 / 16),  # cut at max_new_tokens = 16 without <|im_end|>
        ("1234", 0.0),
        ("", 0.0),
    ],
)
def test_reverse_reward_gives_partial_credit(response, expected):
    assert task_reward.score(response, "4321", "mcore_rl/reverse", None) == pytest.approx(expected)


def test_reverse_reward_matches_the_documented_formula():
    import random

    rng = random.Random(0)
    for _ in range(2000):
        truth = "".join(rng.choice("0123") for _ in range(rng.randint(2, 12)))
        answer = "".join(rng.choice("0123") for _ in range(rng.randint(0, 16)))
        if rng.random() < 0.2:
            answer = truth
        in_place = sum(1 for i in range(min(len(answer), len(truth))) if answer[i] == truth[i])
        expected = 1.0 if answer == truth else 0.5 * in_place / max(len(answer), len(truth))
        assert task_reward.score(answer, truth, "mcore_rl/reverse") == pytest.approx(expected)
    # the one-token kinds keep the all-or-nothing reward: no partial credit
    assert task_reward.score("4320", "4321", "mcore_rl/majority") == 0.0


@pytest.mark.parametrize(
    "response,truth,expected",
    [
        ("so the answer is \\boxed{3/4}", "3/4", 1.0),
        ("0.75", "\\frac{3}{4}", 1.0),
        ("first 2, finally \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{5}<|im_end|>", "5", 1.0),
        ("The answer is 5", "6", 0.0),
        ("\\boxed{2x+2}", "2(x+1)", 1.0),
        ("I do not know", "2", 0.0),
    ],
)
def test_math_reward_uses_math_verify_equivalence(response, truth, expected):
    assert math_reward.score(response, truth) == expected


def test_overlong_penalty_matches_the_dapo_formula():
    pen = OverlongPenalty(max_new_tokens=20, buffer=4, factor=0.5)
    # Independent piecewise reference: free up to 16 tokens, then -0.5 * (n - 16) / 4, capped at -0.5.
    expected = {0: 0.0, 16: 0.0, 17: -0.125, 18: -0.25, 20: -0.5, 25: -0.5}
    assert {n: pen(n) for n in expected} == pytest.approx(expected)


@pytest.mark.parametrize("buffer,factor", [(21, 1.0), (-1, 1.0), (4, -1.0)])
def test_overlong_penalty_rejects_bad_settings(buffer, factor):
    with pytest.raises(ValueError, match="overlong"):
        OverlongPenalty(max_new_tokens=20, buffer=buffer, factor=factor)


def test_builtin_names_and_module_function_resolve():
    assert resolve_reward_fn("task") is task_reward.score
    assert resolve_reward_fn("math") is math_reward.score
    assert resolve_reward_fn("mcore_rl.rewards.task:score") is task_reward.score


@pytest.mark.parametrize(
    "name,match",
    [
        ("no_such_module_xyz:score", "cannot import module 'no_such_module_xyz'"),
        ("mcore_rl.rewards.task:nope", "has no callable 'nope'"),
        ("tasks", "neither a built-in reward"),
    ],
)
def test_bad_reward_names_fail_at_start_up(name, match):
    with pytest.raises(ValueError, match=match):
        RewardScorer.from_config(RewardConfig(fn=name), max_new_tokens=8)


@pytest.fixture
def user_reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent("""
        def length_or_fail(response, ground_truth, data_source, extra):
            if response == "boom":
                raise RuntimeError("user reward exploded")
            return float(len(response) == int(ground_truth))
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards:length_or_fail"


def test_raising_reward_is_counted_and_scored_zero(user_reward_module):
    scorer = RewardScorer(user_reward_module, max_new_tokens=8)
    out = scorer(["abc", "boom", "ab", "boom"], [3, 4, 3, 1], ["s"] * 4)
    assert out.rewards == [1.0, 0.0, 0.0, 0.0]
    assert out.errors == 2 and "user reward exploded" in out.first_error
    assert out.valid == [True, False, True, False]


@pytest.mark.parametrize(
    "returned, message",
    [("'1.0'", "not a number"), ("float('nan')", "not a finite"), ("float('inf')", "not a finite"), ("None", "None")],
)
def test_non_numeric_or_non_finite_reward_is_an_error(tmp_path, monkeypatch, returned, message):
    """A string "1.0" is not silently cast, NaN/inf are not passed on: each is a counted reward error."""
    module = f"odd_rewards_{abs(hash(returned))}"  # one module per case: imports are cached
    (tmp_path / f"{module}.py").write_text(f"def score(r, gt, ds, ex):\n    return {returned} if r == 'x' else 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = RewardScorer(f"{module}:score", max_new_tokens=8)(["x", "y", "x"], ["1"] * 3, ["s"] * 3)
    assert out.valid == [False, True, False] and out.errors == 2 and out.error_rate == pytest.approx(2 / 3)
    assert out.rewards == [0.0, 1.0, 0.0] and message in out.first_error


def test_numpy_and_torch_scalars_and_bools_are_numbers():
    import numpy as np
    import torch

    from mcore_rl.rewards.registry import check_reward_value

    assert [check_reward_value(v) for v in (np.float32(0.5), torch.tensor(2.0), True, 3)] == [0.5, 2.0, 1.0, 3.0]


def test_scorer_adds_overlong_penalty_to_task_reward():
    scorer = RewardScorer.from_config(
        RewardConfig(fn="task", overlong_buffer=2, overlong_penalty=1.0), max_new_tokens=4
    )
    out = scorer(["1", "1", "2"], ["1", "1", "1"], ["s"] * 3, response_lengths=[2, 3, 4])
    assert out.task_rewards == [1.0, 1.0, 0.0]
    assert out.rewards == pytest.approx([1.0, 0.5, -1.0])
    with pytest.raises(ValueError, match="response_lengths"):
        scorer(["1"], ["1"], ["s"])


def test_batch_size_mismatch_is_an_error():
    with pytest.raises(ValueError, match="sizes differ"):
        RewardScorer("task", max_new_tokens=4)(["1", "2"], ["1"], ["s", "s"])


def test_reward_that_never_returns_times_out_in_its_worker(tmp_path, monkeypatch):
    """A hung reward used to hang the run forever: the worker process is killed after reward.timeout_s,
    the batch counts as reward errors with the reason, and the next batch gets a fresh worker."""
    (tmp_path / "hanging_reward.py").write_text(
        "import time\ndef score(r, gt, ds, ex):\n    if r == 'hang':\n        time.sleep(3600)\n    return 1.0\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")  # the spawned worker imports it
    monkeypatch.syspath_prepend(str(tmp_path))
    scorer = RewardScorer("hanging_reward:score", max_new_tokens=8, timeout_s=3)
    try:
        out = scorer(["a", "hang", "b"], ["1"] * 3, ["s"] * 3)
        assert out.valid == [False] * 3 and out.errors == 3
        assert "did not return within reward.timeout_s = 3 s" in out.first_error
        hung = scorer.worker
        assert hung._proc is None  # killed
        out = scorer(["a", "b"], ["1"] * 2, ["s"] * 2)
        assert out.valid == [True, True] and out.rewards == [1.0, 1.0]
    finally:
        scorer.close()


@pytest.mark.parametrize("timeout_s", [0.0, 30.0], ids=["in-process", "worker"])
def test_a_reward_that_calls_sys_exit_is_a_reward_error(timeout_s, monkeypatch):
    """sys.exit(0) in the reward ended the trainer with status 0 (timeout_s = 0: in its process) and no
    checkpoint: it is a reward error like any other exception, in this process and in the worker."""
    monkeypatch.setenv("PYTHONPATH", f"{REPO}:{os.environ.get('PYTHONPATH', '')}")  # the spawned worker imports it
    scorer = RewardScorer("tests.faulty_reward:exits", max_new_tokens=8, timeout_s=timeout_s)
    try:
        out = scorer(["a", "b"], ["1"] * 2, ["s"] * 2)
    finally:
        scorer.close()
    assert out.valid == [False, False] and out.errors == 2
    assert out.first_error == "SystemExit: it called sys.exit(0) (on response 'a')"


def test_the_builtin_task_reward_runs_in_the_trainer_and_scores_as_its_worker_would(monkeypatch):
    """reward.fn=task cannot hang (string comparisons): no worker process even with reward.timeout_s > 0, and the
    same rewards, validity and penalties as the same function in a RewardWorker (the path every other reward takes)."""
    monkeypatch.setenv("PYTHONPATH", f"{REPO}:{os.environ.get('PYTHONPATH', '')}")  # the spawned worker imports it
    texts = ["7", " 7\n", "71", "", "21<|im_end|>", "12", "213", "2"]
    truths = ["7", "7", "7", "7", "21", "21", "21", "21"]
    sources = ["mcore_rl/copy_kth"] * 4 + ["mcore_rl/reverse"] * 4
    lengths = [1, 2, 2, 1, 3, 8, 8, 1]
    scorer = RewardScorer("task", max_new_tokens=8, overlong_buffer=2, timeout_s=300)
    reference = RewardScorer("mcore_rl.rewards.task:score", max_new_tokens=8, overlong_buffer=2, timeout_s=300)
    try:
        assert scorer.worker is None and reference.worker is not None
        got = scorer(texts, truths, sources, response_lengths=lengths)
        want = reference(texts, truths, sources, response_lengths=lengths)
        assert reference.worker._proc is not None  # the reference did score in its worker
    finally:
        scorer.close()
        reference.close()
    assert got == want
    assert got.rewards == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0 - 1.0, 0.5 * 2 / 3 - 1.0, 0.25]
    assert RewardScorer("math", max_new_tokens=8, timeout_s=300).worker is not None  # math-verify can hang
