"""Each rank's trainer state (mcore_rl/run_dir/trainer_state.py): read with weights_only=True, so a checkpoint
from someone else runs no code; an older pickled one only with checkpoint.trust_pickle (issue 34, 10). The state
of a real run reading back this way, and exact resume with it: tests/test_trainer_e2e.py."""

import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mcore_rl.config import ConfigError
from mcore_rl.run_dir import check_pickles, read_state, rng_state, set_rng_state
from tests.test_resume_changes import PRESET, _saved_run
from tests.torchrun_util import REPO


def _draws() -> tuple:
    return torch.rand(3).tolist(), random.random(), np.random.rand(2).tolist(), np.random.randn()


class _RunsCode:
    """What an attacker's pickle holds: unpickling it calls Path.touch(marker)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _old_format_state() -> dict:
    """The trainer state as checkpoints before this format held it: numpy's random state as its tuple (an ndarray)."""
    return {
        "step": 4,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
    }


def test_random_states_round_trip_through_a_weights_only_load(tmp_path):
    """The draws after restoring equal the draws that followed the save: torch, Python and numpy (including numpy's
    cached Gaussian, set by an odd number of randn draws)."""
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    np.random.randn()  # leaves a cached Gaussian in numpy's state
    torch.save({"step": 7, "rng": rng_state()}, tmp_path / "state.pt")
    want = _draws()
    _draws()  # move every stream on
    state = torch.load(tmp_path / "state.pt", weights_only=True)  # plain tensors and types only
    set_rng_state(state["rng"])
    assert state["step"] == 7 and _draws() == want


def test_a_pickled_state_is_refused_unless_trusted(tmp_path, caplog):
    """A state whose unpickling runs code is refused without running it, naming checkpoint.trust_pickle; an older
    checkpoint's state reads with the flag (a warning), and its random states restore as before."""
    marker = tmp_path / "code_ran"
    torch.save({"step": 4, "evil": _RunsCode(marker)}, tmp_path / "evil.pt")
    with pytest.raises(ConfigError, match=r"evil.pt holds Python objects .* set checkpoint.trust_pickle=true"):
        read_state(tmp_path / "evil.pt", trust_pickle=False)
    assert not marker.exists()

    old = _old_format_state()
    torch.save(old, tmp_path / "old.pt")
    want = _draws()
    # megatron-core 0.16.1 allows numpy's arrays process-wide when imported (megatron/core/safe_globals.py): the ranks
    # must refuse what the pre-flight, without Megatron, refuses
    numpy_globals = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(numpy_globals):
        allowed = set(torch.serialization.get_safe_globals())
        with pytest.raises(ConfigError, match="trust_pickle=true"):
            read_state(tmp_path / "old.pt", trust_pickle=False)
        # and the process's list is as it was (compared inside the context: leaving it removes numpy's globals,
        # which an earlier test's Megatron import may have added process-wide)
        assert set(torch.serialization.get_safe_globals()) == allowed
    with caplog.at_level(logging.WARNING):
        state = read_state(tmp_path / "old.pt", trust_pickle=True, log=logging.getLogger("test"))
    assert any("full unpickling" in r.getMessage() for r in caplog.records)
    set_rng_state(state["rng"])
    assert _draws() == want


def test_what_megatron_and_torch_unpickle_is_checked_first(tmp_path):
    """torch.distributed.checkpoint unpickles actor/.metadata with a plain pickle.load, and megatron-core 0.12.1
    reads actor/common.pt with weights_only=False: check_pickles reads both first, the metadata with an unpickler
    that builds only torch.distributed.checkpoint's own classes. A real dist checkpoint passes; one whose metadata or
    common.pt would run code is refused, naming the file and checkpoint.trust_pickle, and the code never runs."""
    import pickle

    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "step_00000004"
    dcp.save({"w": torch.ones(3, 2), "b": torch.zeros(2, dtype=torch.bfloat16)}, checkpoint_id=ckpt / "actor")
    torch.save({"optimizer": {"param_groups": [{"lr": 1e-3}]}, "extra": {}}, ckpt / "actor" / "common.pt")
    torch.save({"step": 4, "rng": rng_state()}, ckpt / "trainer_state_rank0.pt")
    check_pickles(ckpt, trust_pickle=False)  # what this project and torch write: nothing refused

    marker = tmp_path / "code_ran"
    real = (ckpt / "actor" / ".metadata").read_bytes()
    (ckpt / "actor" / ".metadata").write_bytes(pickle.dumps((pickle.loads(real), _RunsCode(marker))))
    with pytest.raises(ConfigError, match=r"actor/.metadata holds Python objects .*pathlib.*checkpoint.trust_pickle"):
        check_pickles(ckpt, trust_pickle=False)
    (ckpt / "actor" / ".metadata").write_bytes(real)
    torch.save({"extra": _RunsCode(marker)}, ckpt / "actor" / "common.pt")
    with pytest.raises(ConfigError, match=r"actor/common.pt holds Python objects .*checkpoint.trust_pickle"):
        check_pickles(ckpt, trust_pickle=False)
    assert not marker.exists()
    check_pickles(ckpt, trust_pickle=True)  # trusted: left to torch and Megatron, as before


def test_train_refuses_an_old_pickled_state_before_any_process_starts(tmp_path, tiny_model_dir):
    """Through `mcore-rl train`: one line naming the file and checkpoint.trust_pickle, exit 2, nothing written."""
    import io

    from mcore_rl.data.task import make_task_dataset

    train, val = make_task_dataset(tmp_path / "task", train_size=64, val_size=8, seed=0)
    run = tmp_path / "run"
    args = [
        f"model.path={tiny_model_dir}",
        f"data.train_path={train}",
        f"data.val_path={val}",
        f"trainer.run_dir={run}",
    ]
    pickled = io.BytesIO()
    torch.save(_old_format_state(), pickled)
    ckpt = _saved_run(run, *args, state=pickled.getvalue())
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    proc = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli", "train", str(PRESET), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("mcore-rl: error:")]
    assert len(errors) == 1 and proc.stderr.strip().endswith(errors[0]), proc.stderr[-3000:]
    assert f"{ckpt / 'trainer_state_rank0.pt'} holds Python objects" in errors[0]
    assert "checkpoint.trust_pickle=true" in errors[0]
    assert "process(es) on" not in proc.stdout  # torchrun was never started
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
