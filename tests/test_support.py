"""The support matrix (mcore_rl.preflight.support) through `mcore-rl check`: each vLLM-Ascend / MindSpeed / torch
combination is passed in as installed metadata (these packages do not install here) and must be accepted or
refused as docs/versions.md states. The expectations below are the matrix written out, not computed by the
module under test."""

import pytest

from mcore_rl.cli import main
from mcore_rl.preflight import support
from tests.torchrun_util import REPO

NPU_PRESET = REPO / "configs" / "qwen3_30b_a3b" / "npu16_tp4_ep4.yaml"
GPU_PRESET = REPO / "configs" / "qwen3_30b_a3b" / "gpu8_tp2_ep8.yaml"
QWEN_JSON = REPO / "configs" / "qwen3_30b_a3b" / "config.json"

# vllm-ascend release -> (the torch its wheel pins, its torch_npu pin, the vLLM it plugs into)
ASCEND = {
    "0.11.0": ("2.7.1", "2.7.1.post4", "0.11.0"),
    "0.13.0": ("2.8.0", "2.8.0.post2", "0.13.0"),
    "0.18.0": ("2.9.0", "2.9.0", "0.18.0"),
    "0.23.0": ("2.10.0", "2.10.0.post4", "0.23.0"),
}
# MindSpeed as installed: its setup.py names the megatron-core it patches (every release line: 0.12.1);
# None: not installed; "0.14.1": the core_r0.14.0 branch, next to megatron-core 0.12.1
MINDSPEED = ["0.12.1", None, "0.14.1"]


def fake(**versions):
    """A metadata provider: distribution name -> version (absent: None)."""
    table = {k.replace("_", "-"): v for k, v in versions.items()}
    return lambda distribution: table.get(distribution.replace("_", "-"))


def check(preset, version_of, capsys, *extra):
    code = main(["check", str(preset), "--model-config", str(QWEN_JSON), *extra], version_of=version_of)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("mindspeed", MINDSPEED, ids=lambda m: f"mindspeed-{m}")
@pytest.mark.parametrize("torch_from", ["engine", "mindspeed"])
@pytest.mark.parametrize("ascend", sorted(ASCEND))
def test_check_accepts_exactly_the_matrix_on_npu(ascend, torch_from, mindspeed, capsys):
    pin, npu_pin, vllm = ASCEND[ascend]
    torch = pin if torch_from == "engine" else "2.7.1"  # MindSpeed's PyTorch (every release lists 2.7.1)
    installed = fake(
        torch=torch,
        torch_npu=npu_pin if torch == pin else "2.7.1",
        vllm=vllm,
        vllm_ascend=ascend,
        mindspeed=mindspeed,
        megatron_core="0.12.1",
        transformers="4.57.1",
    )
    code, out, err = check(NPU_PRESET, installed, capsys)
    # the matrix: only vLLM-Ascend 0.11 runs on the torch of a released MindSpeed (2.7.1)
    accepted = ascend == "0.11.0" and mindspeed != "0.14.1"
    assert code == (0 if accepted else 2), out + err
    if accepted:
        assert "stack: supported: vllm-ascend 0.11.0 + vllm 0.11.x + torch 2.7.1" in out
        assert "MindSpeed 2.2.0_core_r0.12.1 / 2.3.0_core_r0.12.1 / 26.0.0_core_r0.12.1 / 26.1.0_core_r0.12.1" in out
        return
    (line,) = [
        l for l in err.splitlines() if l.startswith("mcore-rl: error: installed stack outside the support matrix")
    ]
    assert "install vllm-ascend 0.11.0 + vllm 0.11.x + torch 2.7.1 + torch_npu 2.7.1" in line  # the nearest stack
    if ascend != "0.11.0" and torch == pin:
        assert f"vllm-ascend {ascend} needs torch {pin}, but no MindSpeed release supports it" in line
    if ascend != "0.11.0" and torch != pin:
        assert f"vllm-ascend {ascend} is built for torch {pin}, torch 2.7.1 is installed" in line
    if mindspeed == "0.14.1":
        assert "MindSpeed for megatron-core 0.14.1" in line and "with megatron-core 0.12.1" in line


@pytest.mark.parametrize(
    "versions, refusal",
    [
        (dict(vllm_ascend="0.10.2rc1", vllm="0.10.2"), "vllm-ascend 0.10.2rc1 is not a release line of the matrix"),
        (dict(vllm_ascend="0.12.0rc1", vllm="0.12.0"), "vllm-ascend 0.12.0rc1 is not a release line of the matrix"),
        (dict(vllm_ascend="0.11.0", vllm="0.10.2"), "the plugin needs vllm 0.11.x (same minor)"),
        (dict(vllm_ascend="0.11.0", vllm="0.11.0", torch_npu="2.8.0"), "torch_npu 2.8.0 is built for torch 2.8.0"),
    ],
)
def test_check_refuses_lines_and_pairs_outside_the_matrix(versions, refusal, capsys):
    base = dict(torch="2.7.1", torch_npu="2.7.1", mindspeed="0.12.1", megatron_core="0.12.1", transformers="4.57.1")
    code, out, err = check(NPU_PRESET, fake(**{**base, **versions}), capsys)
    assert code == 2 and refusal in err, out + err


def test_outside_but_not_refused_is_named_on_its_own_line(capsys):
    # verl's Ascend image: transformers 4.57.6 next to a vLLM-Ascend 0.11 whose wheel requires <= 4.57.1
    installed = fake(torch="2.7.1", torch_npu="2.7.1", vllm="0.11.0", vllm_ascend="0.11.0", mindspeed="0.12.1",
                     megatron_core="0.12.1", transformers="4.57.6")  # fmt: skip
    code, out, err = check(NPU_PRESET, installed, capsys)
    assert code == 0, err
    assert (
        "stack: outside the support matrix: transformers 4.57.6 with vllm-ascend 0.11.0, whose wheel requires <=4.57.1"
        in out.splitlines()
    )


def test_no_ascend_package_installed_is_not_judged(capsys):
    code, out, _ = check(NPU_PRESET, fake(torch="2.13.0+cpu", megatron_core="0.16.1"), capsys)
    assert code == 0 and "stack: no Ascend package installed here" in out


def test_cuda_stack(capsys):
    code, out, err = check(GPU_PRESET, fake(torch="2.9.0", vllm="0.9.2", megatron_core="0.16.1"), capsys)
    assert code == 2 and "vllm 0.9.2 (the matrix: vllm <0.34,>=0.10 with megatron-core" in err
    ok = fake(torch="2.11.0", vllm="0.23.0", megatron_core="0.16.1", transformer_engine="2.9.0")
    code, out, err = check(GPU_PRESET, ok, capsys)
    assert code == 0 and "stack: CUDA: vllm 0.23.0, megatron-core 0.16.1" in out and "outside" not in out
    old = fake(torch="2.11.0", vllm="0.23.0", megatron_core="0.14.0")
    code, out, err = check(GPU_PRESET, old, capsys)
    assert code == 0 and "stack: outside the support matrix: megatron-core 0.14.0 on CUDA" in out
    assert "stack: outside the support matrix: no transformer-engine on CUDA" in out


def test_first_release_with_names_the_matrix_rows():
    assert "is 0.18.0, which needs torch 2.9.0" in support.first_release_with("routed_experts")
    assert "is 0.23.0, which needs torch 2.10.0" in support.first_release_with("logprobs_mode")
    assert [r.version for r in support.supported_ascend_releases()] == ["0.11.0"]
