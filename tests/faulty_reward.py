"""A reward function that misbehaves on a schedule, for the NaN / reward-error end-to-end test.

Each sample is scored once, by the rank that generated it (mcore_rl.rollout.data_parallel.LocalRollout.scored):
with the embedded engine and 2 ranks, rank r scores samples [8 r, 8 r + 8) of every step, in order. So call k
of rank r (RANK, inherited by the reward worker process) is sample 8 r + k % 8 of training step k // 8 + 1
(the test runs without validation).
  step 1: NaN, the string "1.0" and an exception on the first sample of three groups; the task reward elsewhere
  steps 2 and 4: 1e30 on the first sample of each group (with Dr.GRPO advantages the gradient norm overflows)
  other steps: the task reward
"""

import itertools
import os

from mcore_rl.rewards.task import score as task_score

SAMPLES_PER_STEP = 16  # data.prompts_per_step 4 x rollout.n 4 in the test
WORLD = 2  # the test's ranks: each scores its contiguous half of a step
GROUP = 4
_calls = itertools.count()


def score(response, ground_truth, data_source=None, extra=None):
    k = next(_calls)
    per_rank = SAMPLES_PER_STEP // WORLD
    step, index = k // per_rank + 1, int(os.environ.get("RANK", "0")) * per_rank + k % per_rank
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


def interrupts(response, ground_truth, data_source=None, extra=None):
    raise KeyboardInterrupt  # a reward function's own KeyboardInterrupt: its failure, not a stop request


def exits(response, ground_truth, data_source=None, extra=None):
    """sys.exit(0) inside the reward: in the trainer's process (reward.timeout_s = 0) it used to end the run."""
    import sys

    sys.exit(0)


def kills_its_process(response, ground_truth, data_source=None, extra=None):
    import signal

    os.kill(os.getpid(), signal.SIGKILL)  # with reward.timeout_s = 0 that is the trainer's rank
