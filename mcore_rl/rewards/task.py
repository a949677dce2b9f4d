"""Reward of the embedded task (mcore_rl.data.task), picked by the row's data_source.

The answer is the response text before the first <|im_end|> (the whole text when the engine stripped it
or stopped at max_new_tokens), with surrounding whitespace removed: " 9\n<|im_end|>" counts as "9".
Whitespace is tolerated because it carries no information and a char-level model emits it often.

One-token kinds (majority, copy_kth): all-or-nothing, no format credit; anything next to the answer ("9x",
"99") scores 0. <|im_end|> itself is not required: a randomly initialised model emits it with probability
~1/128, so "answer, <|im_end|>" is too rare to learn from scratch; run them with rollout.max_new_tokens=1
(see benchmarks/task_learnability.py).

"reverse" (multi-token answers, `score_reverse`), with answer a and ground truth t:
  1.0                                                        if a == t
  0.5 * #{i < min(|a|, |t|) : a[i] == t[i]} / max(|a|, |t|)   otherwise
Full credit needs the answer to end exactly where t ends: the engine stops at <|im_end|>, so a response
that goes on after the right symbols, or runs to max_new_tokens without <|im_end|> (max_new_tokens is
longer than every answer), is not equal to t. The partial half rewards each symbol in its place and
divides by the longer length, so stopping early and running on both cost credit.
"""

from __future__ import annotations

from typing import Optional

END_OF_TURN = "<|im_end|>"


def extract_answer(response_text: str) -> str:
    return response_text.split(END_OF_TURN, 1)[0].strip()


def score_symbol(response_text: str, ground_truth: str) -> float:
    """All-or-nothing on the answer."""
    return 1.0 if extract_answer(response_text) == str(ground_truth).strip() else 0.0


def score_reverse(
    response_text: str, ground_truth: str, data_source: Optional[str] = None, extra: Optional[dict] = None
) -> float:
    """1.0 for the exact answer, else half the fraction of symbols in their place (module docstring)."""
    answer, truth = extract_answer(response_text), str(ground_truth).strip()
    if answer == truth:
        return 1.0
    matches = sum(a == t for a, t in zip(answer, truth))
    return 0.5 * matches / max(len(answer), len(truth), 1)


def score(
    response_text: str, ground_truth: str, data_source: Optional[str] = None, extra: Optional[dict] = None
) -> float:
    """reward.fn "task": the scorer of the row's task kind (data_source "mcore_rl/KIND")."""
    if data_source == "mcore_rl/reverse":
        return score_reverse(response_text, ground_truth)
    return score_symbol(response_text, ground_truth)
