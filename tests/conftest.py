"""Shared fixtures: the tiny checkpoint is made once per session into a temp folder (real files)."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from mcore_rl.models.tiny import make_tiny_checkpoint

    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe"), seed=0))
