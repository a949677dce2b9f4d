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
