"""Shared fixtures: the tiny checkpoint is made once per session into a temp folder (real files)."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from mcore_rl.models.tiny import make_tiny_checkpoint

    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe"), seed=0))


@pytest.fixture(scope="session")
def tiny_dense_dirs(tmp_path_factory):
    """{"qwen3": dir, "qwen2": dir}: the tiny dense checkpoints (Qwen3 untied with QK-norm; Qwen2 tied with biases)."""
    from mcore_rl.models.tiny import make_tiny_checkpoint

    return {
        arch: str(make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny_{arch}"), seed=0, arch=arch))
        for arch in ("qwen3", "qwen2")
    }


@pytest.fixture(scope="session")
def tiny_arch_dir(tiny_model_dir, tiny_dense_dirs):
    """arch -> tiny checkpoint folder, for tests parametrized over qwen3-moe / qwen3 / qwen2."""
    return {"qwen3-moe": tiny_model_dir, **tiny_dense_dirs}.get


# The separate placement at rollout.max_staleness 0 must train exactly this run (docs/placement.md, "Exact at zero
# staleness"): tests/test_placement_e2e.py checks it under torchrun, tests/test_ray_launch.py under Ray.
EXACT_TOKENS = {"rollout.max_new_tokens": 6}  # decode steps between which a streaming engine could take weights


@pytest.fixture(scope="session")
def colocated_reference(tmp_path_factory, tiny_model_dir):
    """The colocated run on 1 process (gspo_cpu.yaml, the e2e tests' settings, EXACT_TOKENS), once a session:
    (its run directory, the task (train, val) it trained on)."""
    from mcore_rl.data.task import make_task_dataset
    from tests.test_trainer_e2e import overrides, run_train

    made = make_task_dataset(tmp_path_factory.mktemp("reference_task"), train_size=256, val_size=32, seed=0)
    task = (str(made[0]), str(made[1]))
    run_dir = tmp_path_factory.mktemp("reference") / "colocated"
    one = {"trainer.nproc": 1, "actor.parallel.ep": 1}
    run_train("gspo_cpu.yaml", overrides(tiny_model_dir, task, run_dir, **one, **EXACT_TOKENS))
    return run_dir, task
