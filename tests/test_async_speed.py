"""benchmarks/async_speed.py's long-tail data (configs/tiny/gspo_longtail_cpu.yaml) and its length summary."""

import json

import pyarrow.parquet as pq
import yaml

from benchmarks.async_speed import LONG_SHARE, LONGTAIL_DIR, _lengths, make_longtail_task
from mcore_rl.rewards.task import score
from tests.torchrun_util import REPO


def test_longtail_task_is_mostly_short_with_a_long_tail(tmp_path):
    make_longtail_task(str(tmp_path), train_size=2000, val_size=200, seed=0)
    train = pq.read_table(tmp_path / "train.parquet").to_pylist()
    val = pq.read_table(tmp_path / "val.parquet").to_pylist()
    lengths = [len(r["extra_info"]["symbols"]) for r in train]
    assert set(lengths) <= set(range(2, 5)) | set(range(20, 29))
    assert set(lengths) >= {2, 3, 4, 20, 28}
    long = sum(n >= 20 for n in lengths) / len(lengths)
    assert abs(long - LONG_SHARE) < 0.025  # 4 standard deviations of the share of 2,000 draws
    for r in train[:50]:  # the reverse task's rows: answer reversed, scored by the reverse scorer
        assert r["reward_model"]["ground_truth"] == r["extra_info"]["symbols"][::-1]
        assert score(r["reward_model"]["ground_truth"], r["reward_model"]["ground_truth"], r["data_source"]) == 1.0
    assert [r["prompt"] for r in val] != [r["prompt"] for r in train[:200]]
    # the preset reads what the generator writes by default
    preset = yaml.safe_load((REPO / "configs/tiny/gspo_longtail_cpu.yaml").read_text())
    assert preset["data"]["train_path"] == f"{LONGTAIL_DIR}/train.parquet"


def test_lengths_summary_from_the_sample_log(tmp_path):
    lengths = [3] * 50 + [4] * 30 + [5] * 10 + [12] * 9 + [14]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps({"length": n}) + "\n" for n in lengths))
    # 100 samples: median between the 50th and 51st (3 and 4), p75 the 76th smallest (4), p90 the 91st (12), p99 the
    # 100th (14), mean (150 + 120 + 50 + 108 + 14) / 100
    assert _lengths(tmp_path) == "; lengths median 3.5, p75 4, p90 12, p99 14, max 14, mean 4.4 (n 100)"
    assert _lengths(tmp_path / "missing") == ""
