"""Weight sync from a real 2-process Megatron actor (TP2+SP, EP2) into the embedded engine on rank 0.

The worker (tests/workers/sync_megatron.py) checks, with the actor's own forward as the reference:
an unsynced engine fails verification naming tensors; a sync with a bucket smaller than the largest tensor
makes engine log-probs equal the actor's (<= 1e-4) on a probe and on sampled sequences; routed experts
captured by the engine equal the actor router's choices; after the actor's weights change a stale engine
fails verification and a new sync fixes it; corrupted engine experts are caught and rebuilt exactly.
"""

import json

import pytest

from mcore_rl.models.tiny import make_tiny_checkpoint
from tests.torchrun_util import REPO, run_torchrun

WORKER = REPO / "tests" / "workers" / "sync_megatron.py"


@pytest.fixture(scope="module")
def actor_dir(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("sync_actor_seed1"), seed=1))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_sync_from_megatron_actor(layout, tiny_model_dir, actor_dir):
    out = run_torchrun(WORKER, 2, layout, tiny_model_dir, actor_dir, timeout=240)
    line = next(l for l in out.splitlines() if l.startswith("RESULT "))
    r = json.loads(line[len("RESULT ") :])
    assert r["unsynced_error_names_tensors"]
    assert r["largest"] > r["bucket_bytes"] and r["num_buckets"] > 1
    assert r["verify_max_diff"] <= 1e-4
    assert r["sample_logprob_diff"] <= 1e-4
    assert r["route_mismatches"] == 0 and r["route_shape"][1:] == [2, 2]
    assert r["verify_after_change"] <= 1e-4 and r["engine_change"] > 1e-2
    assert r["corrupt_max_diff"] > 1e-3 and r["rebuilt"] and r["after_rebuild"] <= 1e-4
