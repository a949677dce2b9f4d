"""Bridge pieces that need no process group, and the HF -> Megatron -> HF round trip through files
with the real conversion CLI (Megatron checkpoint written at TP2, read back at EP2 x DP2)."""

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from mcore_rl.models.bridge import RMSNorm, _MbridgeBackend, _te_norm_name, load_hf_config
from mcore_rl.models.shards import merge_shards, split_shards
from tests.torchrun_util import REPO, run_torchrun


def test_rope_theta_restored_from_rope_parameters(tiny_model_dir, tmp_path):
    cfg = json.loads(open(os.path.join(tiny_model_dir, "config.json")).read())
    cfg.pop("rope_theta", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 12345.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_hf_config(str(tmp_path)).rope_theta == 12345.0


def test_rmsnorm_matches_hf_qwen3_moe_norm():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    config = types.SimpleNamespace(params_dtype=torch.float32, sequence_parallel=True)
    ours, theirs = RMSNorm(config, 64, eps=1e-6), Qwen3MoeRMSNorm(64, eps=1e-6)
    weight = torch.randn(64)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    x = torch.randn(3, 5, 64)
    assert torch.allclose(ours(x), theirs(x), atol=1e-6)
    assert ours.weight.sequence_parallel is True  # Megatron all-reduces its grad over TP


@pytest.mark.parametrize(
    "name,shape,dim",
    [
        ("decoder.layers.0.mlp.experts.linear_fc1.weight3", (8, 6), 0),  # gated: [gate; up]
        ("decoder.layers.0.self_attention.linear_qkv.weight", (8, 6), 0),
        ("decoder.layers.0.self_attention.linear_proj.weight", (6, 8), 1),
    ],
)
def test_split_merge_round_trip(name, shape, dim):
    full = torch.arange(48.0).reshape(shape)
    parts = split_shards(name, full, 2, dim, gated=True)
    assert all(p.shape[dim] == shape[dim] // 2 for p in parts)
    assert torch.equal(merge_shards(name, parts, dim, gated=True), full)
    if "linear_fc1" in name:  # each rank holds its slice of gate AND of up
        gate, up = full.chunk(2)
        assert torch.equal(parts[1], torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))


def test_local_norm_names_translate_to_te_names_for_dense_and_moe():
    pre = "decoder.layers.3.pre_mlp_layernorm.weight"
    assert _te_norm_name(pre, moe=False) == "decoder.layers.3.mlp.linear_fc1.layer_norm_weight"  # TE fuses it
    assert _te_norm_name(pre, moe=True) == pre  # MoE keeps a separate norm before the router
    inp = "decoder.layers.0.input_layernorm.weight"
    for moe in (False, True):
        assert _te_norm_name(inp, moe) == "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    qkv_bias = "decoder.layers.0.self_attention.linear_qkv.bias"
    assert _te_norm_name(qkv_bias, moe=False) == qkv_bias


def test_tied_model_does_not_remap_a_later_untied_models_lm_head(monkeypatch):
    """mbridge's Qwen2 bridge writes the tied-embedding remap into a class-level dict that Qwen3's inherits."""
    from mbridge.core.parallel_states import ParallelStates
    from mbridge.models.qwen2 import Qwen2Bridge

    from mcore_rl.models.tiny import build_hf_config

    # no process group here: mbridge reads the (irrelevant) parallel sizes from this instead
    monkeypatch.setattr(ParallelStates, "get_parallel_state", staticmethod(lambda: ParallelStates()))
    monkeypatch.setattr(Qwen2Bridge, "_DIRECT_MAPPING", dict(Qwen2Bridge._DIRECT_MAPPING))  # undone after the test
    names = {}
    for arch in ("qwen2", "qwen3", "qwen2", "qwen3"):
        backend = _MbridgeBackend(build_hf_config(arch=arch), torch.float32, {}, use_te=False)
        names.setdefault(arch, set()).update(backend.hf_names("output_layer.weight"))
    assert names == {"qwen2": {"model.embed_tokens.weight"}, "qwen3": {"lm_head.weight"}}


def test_export_into_a_folder_with_an_earlier_export_leaves_no_stale_weights(tmp_path):
    """RUN_DIR/hf written again (a resumed run's export): an earlier export's shards and index must go,
    else an index reader (mbridge) loads the old weights while transformers loads the new model.safetensors."""
    from safetensors.torch import load_file

    from mcore_rl.models.hf_io import write_hf_folder

    old = {f"w{i}": torch.full((64,), float(i)) for i in range(4)}
    write_hf_folder(old.items(), tmp_path, max_shard_bytes=256)  # 4 shards + index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    (tmp_path / "notes.txt").write_text("kept")
    new = {name: t + 10 for name, t in old.items()}
    assert write_hf_folder(new.items(), tmp_path) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "notes.txt"]
    got = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(got[name], t) for name, t in new.items())
    write_hf_folder(old.items(), tmp_path, max_shard_bytes=256)  # and back to shards: no model.safetensors
    assert sorted(p.name for p in tmp_path.glob("*.safetensors*")) == [
        "model-00001-of-00004.safetensors",
        "model-00002-of-00004.safetensors",
        "model-00003-of-00004.safetensors",
        "model-00004-of-00004.safetensors",
        "model.safetensors.index.json",
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,read_layout",
    [("qwen3-moe", ("--ep", 2)), ("qwen3", ("--pp", 2)), ("qwen2", ("--pp", 2))],
    ids=["qwen3-moe-tp2-to-ep2", "qwen3-tp2-to-pp2", "qwen2-tied-tp2-to-pp2"],
)
def test_hf_to_megatron_to_hf_round_trip(tiny_arch_dir, tmp_path, arch, read_layout):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tiny_arch_dir(arch)
    tool = REPO / "tools" / "convert_checkpoint.py"
    mcore, hf_out = tmp_path / "mcore", tmp_path / "hf"
    run_torchrun(tool, 2, "hf-to-mcore", "--hf", model_dir, "--out", mcore, "--tp", 2, "--platform", "cpu")
    run_torchrun(
        tool,
        2,
        "mcore-to-hf",
        "--hf",
        model_dir,
        "--ckpt",
        mcore,
        "--out",
        hf_out,
        *read_layout,
        "--platform",
        "cpu",
        "--max-shard-gb",
        0.0002,
    )
    index = json.loads((hf_out / "model.safetensors.index.json").read_text())
    got = {}
    for shard in sorted(set(index["weight_map"].values())):
        got.update(load_file(hf_out / shard))
    want = load_file(os.path.join(model_dir, "model.safetensors"))
    assert sorted(got) == sorted(want)  # tied (qwen2): model.embed_tokens.weight once, no lm_head.weight
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    tok = AutoTokenizer.from_pretrained(hf_out)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template

    # Converting again into the folder that holds this export: refused before anything is read or written
    # (the old shards and index used to stay, so index readers and transformers loaded different weights).
    before = {p.name: p.read_bytes() for p in hf_out.iterdir()}
    again = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli", "convert", "mcore-to-hf", "--hf", model_dir, "--ckpt", str(mcore)]
        + ["--out", str(hf_out), "--platform", "cpu"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert again.returncode == 2 and again.stderr.count("\n") == 1, again.stderr
    assert again.stderr.startswith(f"mcore-rl convert: error: --out {hf_out} is not empty"), again.stderr
    assert "write into a new or empty folder" in again.stderr
    assert {p.name: p.read_bytes() for p in hf_out.iterdir()} == before
    ids = torch.tensor([tok("hello world")["input_ids"]])
    a = AutoModelForCausalLM.from_pretrained(hf_out, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert a.config.tie_word_embeddings == b.config.tie_word_embeddings == (arch == "qwen2")
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
