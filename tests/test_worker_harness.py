"""The test-worker protocol (tests/workers/harness.py, tests/torchrun_util.run_worker) with real processes:
named arguments reach the worker, every rank's result comes back, and a worker that writes no result (or the
wrong ranks) fails the test with the worker's own output."""

import json

import pytest

from tests.torchrun_util import named_args, run_worker
from tests.workers.harness import read_results

ECHO = """
import torch
from tests.workers.harness import worker_args, write_result

args = worker_args(__doc__, name=str, count=int, mode=("a", "b"))
write_result(args.results, name=args.name, count=args.count, mode=args.mode, total=torch.tensor(2.5))
"""

SILENT = """
from tests.workers.harness import worker_args

args = worker_args(__doc__)
print("the worker's own words")
"""


def test_named_arguments_in_result_out(tmp_path):
    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    (r,) = run_worker(script, 1, torchrun=False, name="x y", count=3, mode="b").results
    assert r == {"rank": 0, "name": "x y", "count": 3, "mode": "b", "total": 2.5}


def test_worker_without_result_fails_with_its_output(tmp_path):
    script = tmp_path / "silent.py"
    script.write_text(SILENT)
    with pytest.raises(AssertionError, match=r"(?s)expected results \['rank0.json'\].*the worker's own words"):
        run_worker(script, 1, torchrun=False)


def test_bad_argument_fails_with_the_usage(tmp_path):
    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    with pytest.raises(AssertionError, match=r"(?s)exited 2.*invalid choice: 'c'"):
        run_worker(script, 1, torchrun=False, name="x", count=3, mode="c")


def test_every_rank_must_report(tmp_path):
    (tmp_path / "rank0.json").write_text(json.dumps({"rank": 0}))
    (tmp_path / "rank2.json").write_text(json.dumps({"rank": 2}))
    with pytest.raises(AssertionError, match=r"expected results \['rank0.json', 'rank1.json'\].*found"):
        read_results(tmp_path, 2, "output")
    with pytest.raises(AssertionError, match=r"found \['rank0.json', 'rank2.json'\]"):
        read_results(tmp_path, 1)  # a rank too many is as wrong as one too few
    (tmp_path / "rank2.json").unlink()
    (tmp_path / "rank1.json").write_text(json.dumps({"rank": 1}))
    assert read_results(tmp_path, 2) == [{"rank": 0}, {"rank": 1}]


def test_named_args():
    assert named_args({"model_dir": "/m", "tp": 2}) == ["--model-dir", "/m", "--tp", "2"]


def test_write_result_plain_values_per_rank(tmp_path, monkeypatch):
    """Tensors become numbers or lists, paths strings; the file is named by the launcher's RANK; anything else
    is refused with the fix named (no half-written file is left)."""
    import torch

    from tests.workers.harness import write_result

    monkeypatch.setenv("RANK", "3")
    path = write_result(tmp_path, one=torch.tensor(1.5), many=torch.tensor([1, 2]), where=tmp_path, pair=(1, 2))
    assert path == tmp_path / "rank3.json"
    assert json.loads(path.read_text()) == {
        "rank": 3,
        "one": 1.5,
        "many": [1, 2],
        "where": str(tmp_path),
        "pair": [1, 2],
    }
    with pytest.raises(TypeError, match="convert it to a number or string"):
        write_result(tmp_path / "bad", value=object())
    assert not any((tmp_path / "bad").glob("rank*.json"))
