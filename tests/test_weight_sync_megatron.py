"""Weight sync from a real 2-process Megatron actor (TP2+SP, EP2) into the embedded engine on rank 0, for the
tiny Qwen3-MoE and (TP2+SP) the dense Qwen3 and tied Qwen2.

The worker (tests/workers/sync_megatron.py) checks, with the actor's own forward as the reference:
an unsynced engine fails verification naming tensors; a sync with a bucket smaller than the largest tensor
makes engine log-probs equal the actor's (<= 1e-4) on a probe and on sampled sequences; routed experts
captured by the engine equal the actor router's choices; after the actor's weights change a stale engine
fails verification and a new sync fixes it; corrupted engine experts are caught and rebuilt exactly.
"""

import pytest

from mcore_rl.models.tiny import make_tiny_checkpoint
from tests.torchrun_util import REPO, run_worker

WORKER = REPO / "tests" / "workers" / "sync_megatron.py"


@pytest.fixture(scope="module")
def actor_dir(tmp_path_factory):
    """arch -> a tiny checkpoint with other weights (seed 1) than the engine's (seed 0), made on first use."""
    made = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = str(
                make_tiny_checkpoint(tmp_path_factory.mktemp(f"sync_actor_{arch}_seed1"), seed=1, arch=arch)
            )
        return made[arch]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,layout", [("qwen3-moe", "tp2"), ("qwen3-moe", "ep2"), ("qwen3", "tp2"), ("qwen2", "tp2")]
)
def test_sync_from_megatron_actor(arch, layout, tiny_arch_dir, actor_dir):
    args = dict(layout=layout, engine_ckpt=tiny_arch_dir(arch), actor_ckpt=actor_dir(arch))
    results = run_worker(WORKER, 2, **args, timeout=240).results
    assert [x["layout"] for x in results] == [layout] * 2  # both ranks passed every check
    r = results[0]  # rank 0 holds the engine
    assert r["unsynced_error_names_tensors"]
    assert r["largest"] > r["bucket_bytes"] and r["num_buckets"] > 1
    assert r["verify_max_diff"] <= 1e-4
    assert r["sample_logprob_diff"] <= 1e-4
    if arch == "qwen3-moe":
        assert r["route_mismatches"] == 0 and r["route_shape"][1:] == [2, 2]
    else:
        assert r["route_shape"] is None
    assert r["verify_after_change"] <= 1e-4 and r["engine_change"] > 1e-2
    assert r["corrupt_max_diff"] > 1e-3 and r["rebuilt"] and r["after_rebuild"] <= 1e-4
