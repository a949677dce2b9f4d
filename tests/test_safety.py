"""Guards against non-finite updates and failing rewards (no Megatron needed; the end-to-end run with a
real 2-process job is tests/test_trainer_e2e.py::test_bad_rewards_and_non_finite_updates_are_never_applied)."""

import pytest
import torch

from mcore_rl.safety import SkipCounter, TrainingHalted, check_reward_errors, check_weights_finite, first_non_finite


def test_skip_counter_stops_after_n_in_a_row_only():
    counter = SkipCounter(max_consecutive=3)
    counter.record([True], step=1)
    counter.record([False, False], step=2)  # two skipped mini-batch steps
    counter.record([True, False], step=3)  # an applied step resets the run of skips
    assert (counter.total, counter.in_a_row) == (3, 1)
    counter.record([False], step=4)
    with pytest.raises(TrainingHalted, match="3 optimizer steps in a row were skipped.*max_consecutive_skips = 3"):
        counter.record([False], step=5)
    restored = SkipCounter(3)
    restored.load_state_dict(counter.state_dict())
    assert (restored.total, restored.in_a_row) == (5, 3)


def test_non_finite_weights_are_named_and_refused():
    good = [("a", torch.ones(3)), ("steps", torch.tensor([1, 2]))]
    assert first_non_finite(good) is None
    check_weights_finite(good, "not writing checkpoint step 1")
    bad = good + [("layer.weight", torch.tensor([1.0, float("inf")])), ("b", torch.tensor([float("nan")]))]
    assert first_non_finite(bad) == "layer.weight"
    with pytest.raises(TrainingHalted, match="not writing checkpoint step 2: .*NaN/inf \\(first: layer.weight\\)"):
        check_weights_finite(bad, "not writing checkpoint step 2")


def test_reward_error_rate_above_threshold_stops_with_first_error():
    check_reward_errors(2, 4, "ValueError: x", max_rate=0.5, step=1)  # 50 % is not above 50 %
    with pytest.raises(TrainingHalted, match="failed on 4 of 4 samples .*first error: ValueError: boom"):
        check_reward_errors(4, 4, "ValueError: boom", max_rate=0.5, step=3)
