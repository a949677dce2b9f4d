"""Math answer checking with the `math-verify` package.

The ground truth is parsed as an answer (a bare "3/4" or LaTeX such as "\\frac{3}{4}"); the response's
final answer is extracted by math-verify (a \\boxed{} answer first, then the last LaTeX/plain expression)
and compared symbolically, so "0.75", "\\frac34" and "\\boxed{3/4}" all match "3/4".
"""

from __future__ import annotations

from typing import Any, Optional

from mcore_rl.rewards.task import END_OF_TURN


def _parse_gold(ground_truth: Any):
    from math_verify import parse

    text = str(ground_truth).strip()
    gold = parse(text if "$" in text or "\\boxed" in text else f"${text}$")
    return gold or parse(text)  # a plain expression that is not valid LaTeX


def score(
    response_text: str, ground_truth: Any, data_source: Optional[str] = None, extra: Optional[dict] = None
) -> float:
    """1.0 when the response's final answer equals the ground truth mathematically, else 0.0."""
    from math_verify import parse, verify

    gold = _parse_gold(ground_truth)
    if not gold:
        raise ValueError(f"math reward: cannot parse ground truth {ground_truth!r} as an answer")
    pred = parse(response_text.split(END_OF_TURN, 1)[0])
    return 1.0 if pred and verify(gold, pred) else 0.0
