"""The streaming placement's per-token staleness (mcore_rl.placement.token_staleness) against lags counted by hand:
each token's lag from its own version, the histogram over 0 .. max_staleness, and a lag beyond it an error."""

import pytest
import torch

from mcore_rl.batch import RolloutSample
from mcore_rl.placement import token_staleness
from mcore_rl.separate import StepSamples


def sample(versions, n=None):
    count = len(versions) if versions is not None else n
    return RolloutSample([1, 2], list(range(count)), torch.zeros(count), "length", token_versions=versions)


def test_every_token_counts_at_its_own_version():
    # update's starting weights: version 5 (step 6); tokens at versions 3, 4 and 5; one sample without versions
    rounds = [
        {"groups": [[sample([3, 3, 4]), sample([4, 5])]]},
        {"groups": [[sample(None, n=2), sample([5])]]},  # None: every token has the step's version (4)
    ]
    got = token_staleness(StepSamples(6, 4, rounds, {}), step=5, bound=2)
    lags = [2, 2, 1, 1, 0, 1, 1, 0]  # by hand
    assert got["train/staleness_max"] == 2.0
    assert got["train/staleness_mean"] == pytest.approx(sum(lags) / len(lags))
    assert [got[f"train/staleness_hist/{k}"] for k in range(3)] == [lags.count(k) / len(lags) for k in range(3)]
    assert "train/staleness_hist/3" not in got


def test_a_lag_beyond_the_bound_is_an_error_not_a_silent_drop():
    rounds = [{"groups": [[sample([2, 5])]]}]
    with pytest.raises(RuntimeError, match="step 6 got tokens 3 weight versions old, beyond rollout.max_staleness = 2"):
        token_staleness(StepSamples(6, 2, rounds, {}), step=5, bound=2)
