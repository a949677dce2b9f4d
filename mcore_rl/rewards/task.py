"""Reward of the embedded task (mcore_rl.data.task): all-or-nothing on the answer, no format credit.

The answer is the response text before the first <|im_end|> (the whole text when the engine stripped it
or stopped at max_new_tokens), with surrounding whitespace removed: " 9\n<|im_end|>" counts as "9".
Whitespace is tolerated because it carries no information and a char-level model emits it often;
anything else next to the answer ("9x", "99") scores 0.
<|im_end|> itself is not required: a randomly initialised model emits it with probability ~1/128, so
"answer, <|im_end|>" is too rare to learn from scratch; run the task with rollout.max_new_tokens=1
(see benchmarks/task_learnability.py).
"""

from __future__ import annotations

from typing import Optional

END_OF_TURN = "<|im_end|>"


def extract_answer(response_text: str) -> str:
    return response_text.split(END_OF_TURN, 1)[0].strip()


def score(
    response_text: str, ground_truth: str, data_source: Optional[str] = None, extra: Optional[dict] = None
) -> float:
    return 1.0 if extract_answer(response_text) == str(ground_truth).strip() else 0.0
