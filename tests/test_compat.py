"""mcore_rl.compat against the installed libraries: detected versions, the layout rule for megatron-core < 0.13,
RoPE theta from a transformers-5 style config.json, and the numpy shim. Runs in both the default venv and the
compatibility venv (make test-compat); what differs is chosen by the detected versions."""

import inspect
import json
from importlib import metadata

import pytest
import torch
from packaging.version import Version
from torch.distributed.checkpoint.filesystem import _write_item

from mcore_rl.compat import describe_versions, shims_in_force
from mcore_rl.compat import megatron as compat_megatron
from mcore_rl.compat import transformers as compat_transformers
from mcore_rl.config import ParallelConfig
from mcore_rl.preflight.layout import LayoutError, validate_layout


def test_describe_versions_names_installed_versions_and_shims():
    text = describe_versions()
    for dist in ("torch", "megatron-core", "mbridge", "transformers"):
        installed = Version(metadata.version(dist)).base_version
        assert f"{dist} {installed}" in text, text
    for shim in shims_in_force():
        assert f"version shim: {shim.name} ({shim.covers})" in text
    if Version(metadata.version("megatron-core")) < Version("0.13"):
        assert "fp8 quantize without TE" in text
        # torch 2.7 has no serialization_format argument (megatron-core 0.12's call fits it); 2.8+ requires it
        needs_format = "serialization_format" in inspect.signature(_write_item).parameters
        assert ("write_item serialization_format" in text) == needs_format, text
    if Version(metadata.version("mbridge")) < Version("0.15"):
        assert "from_config dtype" in text


def test_brief_versions_is_one_line_naming_every_shim():
    """The training log's start: the same versions, the shims by name only (5 lines on the oldest stack)."""
    brief, shims = describe_versions(brief=True), shims_in_force()
    assert "\n" not in brief and brief.startswith(describe_versions().splitlines()[0] + "; version shims: ")
    assert all(shim.name in brief and shim.why not in brief for shim in shims)
    assert brief.endswith("version shims: none") == (not shims)


@pytest.mark.parametrize("megatron", ["0.12.1", "0.13.1", "0.16.1"])
def test_layout_rule_for_old_megatron(tiny_model_dir, monkeypatch, megatron):
    monkeypatch.setattr(compat_megatron, "version", lambda: Version(megatron))
    rejected = ParallelConfig(tp=2, ep=1, etp=1)
    if megatron == "0.12.1":
        with pytest.raises(LayoutError, match=r"megatron-core 0\.12\.1 \(< 0\.13\).*set actor\.parallel\.etp = 2"):
            validate_layout(rejected, 2, tiny_model_dir)
        assert "virtual_pp = 2 needs megatron-core >= 0.13" in compat_megatron.layout_problem(1, 1, 1, False, 2)
    else:
        assert validate_layout(rejected, 2, tiny_model_dir).etp == 1
        assert compat_megatron.layout_problem(1, 1, 1, False, 2) is None
    # virtual_pp: the actor's own refusal comes first on every version (it cannot train interleaved stages)
    with pytest.raises(
        LayoutError, match=r"^actor\.parallel\.virtual_pp = 2: interleaved .*\.virtual_pp: null \(or 1\)$"
    ):
        validate_layout(ParallelConfig(pp=2, virtual_pp=2), 2, {**_tiny_json(tiny_model_dir), "num_hidden_layers": 4})
    # the neighbouring layouts run on every version: experts split over TP, over EP, or no sequence parallel
    for ok in (ParallelConfig(tp=2, ep=1, etp=2), ParallelConfig(tp=2, ep=2, etp=1), ParallelConfig(tp=1, ep=2)):
        validate_layout(ok, ok.tp * ok.ep, tiny_model_dir)


def _tiny_json(model_dir) -> dict:
    with open(f"{model_dir}/config.json") as f:
        return json.load(f)


@pytest.mark.parametrize("style", ["rope_parameters", "top_level"])
def test_rope_theta_as_config_json_states_it(tiny_model_dir, tmp_path, style):
    """transformers 4.x defaults rope_theta to 10000 when config.json has only rope_parameters (as 5.x writes
    it); the loaded config and the HF model built from it must use the file's theta."""
    from transformers import AutoModelForCausalLM

    raw = _tiny_json(tiny_model_dir)
    raw.pop("rope_theta", None)
    raw.pop("rope_parameters", None)
    theta = 123456.0
    if style == "rope_parameters":
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:
        raw["rope_theta"] = theta
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = compat_transformers.load_config(str(tmp_path))
    assert cfg.rope_theta == theta
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    dim = cfg.head_dim
    expected = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, expected)
    raw.pop("rope_theta", None)
    raw.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="neither rope_theta nor rope_parameters.rope_theta"):
        compat_transformers.load_config(str(tmp_path))


def test_numpy_product_shim_is_scoped():
    import numpy

    compat_megatron.apply_shims()
    from megatron.core.dist_checkpointing import mapping

    in_force = any(s.name == "np.product" for s in compat_megatron.shims())
    assert in_force == (compat_megatron.version() < Version("0.16") and not hasattr(numpy, "product"))
    if in_force:
        assert mapping.np.product((3, 4)) == 12 and mapping.np.zeros is numpy.zeros
        assert not hasattr(numpy, "product")  # numpy itself unchanged


def test_fp8_shim_does_not_stack_on_a_replaced_quantize_param_shard(monkeypatch):
    """MindSpeed binds its own quantize_param_shard into megatron's distrib_optimizer (docs/devices.md, "Facts
    outside the package index"); the megatron-core 0.12 shim must then leave that function in place, and wrap
    megatron's own otherwise."""
    from megatron.core import fp8_utils
    from megatron.core.optimizer import distrib_optimizer

    def mindspeeds(model_params, *args, **kwargs):  # stands for MindSpeed's warning-only replacement
        return "theirs"

    monkeypatch.setattr(distrib_optimizer, "quantize_param_shard", mindspeeds)
    compat_megatron._shim_fp8_quantize()
    assert distrib_optimizer.quantize_param_shard is mindspeeds
    monkeypatch.setattr(distrib_optimizer, "quantize_param_shard", fp8_utils.quantize_param_shard)
    compat_megatron._shim_fp8_quantize()
    shimmed = distrib_optimizer.quantize_param_shard
    assert shimmed is not fp8_utils.quantize_param_shard and shimmed([], None, None, None) is None


@pytest.mark.slow
def test_uneven_reduce_scatter_on_gloo():
    """torch < 2.8's gloo has no list-form reduce_scatter (megatron's MoE dispatcher, uneven TP splits): the
    compat shim (a padded all_reduce), and torch's own where it exists, equal the reduction each rank
    computes independently (tests/workers/reduce_scatter_check.py)."""
    from tests.torchrun_util import REPO, run_worker

    run = run_worker(REPO / "tests/workers/reduce_scatter_check.py", 2)
    shim = Version(torch.__version__.split("+")[0]) < Version("2.8")
    assert [r["shim"] for r in run.results] == [shim, shim]
    assert [r["cases"] for r in run.results] == [16, 16]
    assert any(s.name == "gloo reduce_scatter" for s in shims_in_force()) == shim


@pytest.mark.parametrize("version", ["4.53.3", "4.56.2", "4.57.6", "5.24.0"])
def test_preflight_refuses_transformers_below_the_floor(version):
    """4.53.3 (the reference runs') has no dtype= keyword and no supported vLLM-Ascend stack has it: refused
    before launch with the fix; 4.56 is untested, refused too; the tested versions pass."""
    from mcore_rl.config import ConfigError
    from mcore_rl.preflight.inputs import check_transformers

    if Version(version) < Version("4.57"):
        with pytest.raises(
            ConfigError, match=rf"transformers {version} is installed; .*install transformers==4\.57\.6"
        ):
            check_transformers(Version(version))
    else:
        check_transformers(Version(version))
    check_transformers()  # the installed version (every CI stack) passes


BRIDGE_IMPORT = """
import json, sys
from mcore_rl.compat import mbridge as compat_mbridge
from mcore_rl.models.bridge import load_hf_config
from mcore_rl.platform import get_platform

get_platform("cpu").adapt_megatron()  # as every rank does first (Megatron imported without TorchDynamo)
hf_config = load_hf_config(sys.argv[1])
before = set(sys.modules)  # on megatron-core 0.12.1 / torch 2.7.1 the adaptation itself has loaded TorchDynamo
compat_mbridge._import_bridge(hf_config.model_type)
from mbridge import AutoBridge
from mbridge.core.bridge import _MODEL_REGISTRY

bridge = _MODEL_REGISTRY[hf_config.model_type]  # what AutoBridge.from_config builds
out = {"bridge": bridge.__name__, "auto": AutoBridge.__name__, "registered": sorted(_MODEL_REGISTRY),
       "heavy": sorted(m for m in ("torch._dynamo", "torch._inductor", "mbridge.models.glm4_vl")
                         if m in sys.modules and m not in before)}
from mbridge.models import LLaMABridge, Qwen3MoEBridge  # a name asked of the package: every bridge after all
out["after"] = {"llama": LLaMABridge.__name__, "same_class": bridge is Qwen3MoEBridge, "count": len(_MODEL_REGISTRY)}
print(json.dumps(out))
"""


def test_mbridge_imports_only_the_models_bridge(tiny_model_dir):
    """`mbridge.models`' __init__ imports every bridge (TorchDynamo and Inductor with the VL ones): bridge_from_config
    imports the model's own bridge (and its parents) only - it loads none of them - and the package still gives every
    name when asked."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", BRIDGE_IMPORT, tiny_model_dir], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["bridge"] == "Qwen3MoEBridge" and out["registered"] == ["qwen2_moe", "qwen3_moe"], out
    assert out["heavy"] == [], out
    assert out["after"]["llama"] == "LLaMABridge" and out["after"]["same_class"] and out["after"]["count"] > 2, out


def test_moe_forward_with_only_what_cuda_without_te_gets(tiny_model_dir, tmp_path):
    """The tiny Qwen3-MoE through Megatron with the CPU adaptation's device routing alone and the compatibility
    shims (tests/workers/cuda_without_te_moe.py), the process a CUDA machine without Transformer Engine runs
    (the GPU smoke suite's): logits and the routers' gradients equal Hugging Face's. megatron-core >= 0.13 reads
    an unbound `te_general_gemm` in the router's gating without TE (NameError) unless compat shims it."""
    from transformers import AutoModelForCausalLM

    from tests.torchrun_util import REPO, run_worker

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, hf.config.vocab_size, (2, 12), generator=g)
    probe = torch.randn(2, 12, hf.config.vocab_size, generator=g)
    logits = hf(tokens).logits
    (logits * probe).sum().backward()
    ref = tmp_path / "ref.pt"
    torch.save({"tokens": tokens, "probe": probe}, ref)

    (got,) = run_worker(
        REPO / "tests" / "workers" / "cuda_without_te_moe.py", 1, torchrun=False, model_dir=tiny_model_dir, ref=ref
    ).results
    needs_shim = compat_megatron.version() >= Version("0.13")  # TE is never installed here
    assert ("te_general_gemm without TE" in got["shims"]) == needs_shim, got
    assert got["te_general_gemm"] == ("None" if needs_shim else "'undefined'"), got
    # no CPU speed-up: Megatron imported with its torch.compile'd fusions, as on CUDA
    assert got["jit_fuser_compiles"] and got["dynamo_loaded"], got
    assert got["spec"] == "SegmentDotProductAttention", got  # the local spec CUDA builds without TE
    megatron = torch.load(got["out"])
    torch.testing.assert_close(megatron["logits"], logits.detach(), rtol=0, atol=1e-4)
    layers = hf.model.layers
    assert sorted(megatron["router_grads"]) == list(range(len(layers)))
    for i, grad in megatron["router_grads"].items():
        torch.testing.assert_close(grad, layers[i].mlp.gate.weight.grad, rtol=1e-4, atol=1e-5)
