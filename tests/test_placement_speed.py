"""benchmarks/placement_speed.py's step to the reward target: the first step whose trailing mean reaches it."""

import sys

from tests.torchrun_util import REPO

sys.path.insert(0, str(REPO))
from benchmarks.placement_speed import to_target  # noqa: E402


def rows_of(rewards: list[float]) -> list[dict]:
    return [{"step": i + 1, "reward/mean": r, "time": 100.0 + i} for i, r in enumerate(rewards)]


def test_the_target_is_the_first_full_window_whose_mean_reaches_it():
    rows = rows_of([0.9, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    # 3-step means from step 3 on: 0.4, 0.2, 0.3, 0.4, 0.5; step 1's 0.9 alone is no full window
    assert to_target(rows, 0.39, 3)["step"] == 3
    assert to_target(rows, 0.45, 3)["step"] == 7
    assert to_target(rows, 0.51, 3) is None
    assert to_target(rows[:2], 0.1, 3) is None
