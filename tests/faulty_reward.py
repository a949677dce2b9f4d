"""A reward function that misbehaves on a schedule, for the NaN / reward-error end-to-end test.

Every rank scores the same samples in the same order, so counting calls gives the same schedule on
every rank: call k belongs to training step k // SAMPLES_PER_STEP + 1 (the test runs without validation).
  step 1: NaN, the string "1.0" and an exception on the first sample of three groups; the task reward elsewhere
  steps 2 and 4: 1e30 on the first sample of each group (with Dr.GRPO advantages the gradient norm overflows)
  other steps: the task reward
"""

import itertools

from mcore_rl.rewards.task import score as task_score

SAMPLES_PER_STEP = 16  # data.prompts_per_step 4 x rollout.n 4 in the test
GROUP = 4
_calls = itertools.count()


def score(response, ground_truth, data_source=None, extra=None):
    k = next(_calls)
    step, index = k // SAMPLES_PER_STEP + 1, k % SAMPLES_PER_STEP
    if step == 1 and index in (0, 4, 8):
        if index == 0:
            return float("nan")
        if index == 4:
            return "1.0"
        raise RuntimeError("faulty reward raised on purpose")
    if step in (2, 4) and index % GROUP == 0:
        return 1e30
    return task_score(response, ground_truth, data_source, extra)


def always_raises(response, ground_truth, data_source=None, extra=None):
    raise ValueError("this reward always fails")
