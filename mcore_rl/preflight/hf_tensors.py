"""The tensors a Hugging Face checkpoint of a supported architecture holds, from its config.json alone.

`expected_hf_tensors(config)` -> {name: shape} in Hugging Face's naming (the names the bridge reads,
mcore_rl/models/bridge.py, and the export writes), so the pre-flight (mcore_rl/preflight/inputs.py) can compare a
model folder's safetensors headers with its config.json before any process starts. Per architecture
(ARCHITECTURES in mcore_rl/preflight/layout.py):
  all       model.embed_tokens.weight [V, H], model.norm.weight [H], lm_head.weight [V, H] unless tied;
            per layer input_layernorm / post_attention_layernorm [H], self_attn.{q,k,v,o}_proj.weight
  qwen2     q/k/v projections carry a bias; no QK-norm
  qwen3*    self_attn.{q,k}_norm.weight [head_dim]; biases on q/k/v/o only with attention_bias
  dense     mlp.{gate,up}_proj.weight [I, H], mlp.down_proj.weight [H, I]
  qwen3_moe mlp.gate.weight [E, H] and per expert mlp.experts.j.{gate,up,down}_proj.weight with
            moe_intermediate_size; a layer in mlp_only_layers (or off the decoder_sparse_step grid) is dense
"""

from __future__ import annotations

Shape = tuple[int, ...]


def _attention(prefix: str, config: dict, model_type: str) -> dict[str, Shape]:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, groups * head_dim
    out = {
        f"{prefix}.q_proj.weight": (q, hidden),
        f"{prefix}.k_proj.weight": (kv, hidden),
        f"{prefix}.v_proj.weight": (kv, hidden),
        f"{prefix}.o_proj.weight": (hidden, q),
    }
    if model_type == "qwen2":
        out.update({f"{prefix}.q_proj.bias": (q,), f"{prefix}.k_proj.bias": (kv,), f"{prefix}.v_proj.bias": (kv,)})
    else:
        out.update({f"{prefix}.q_norm.weight": (head_dim,), f"{prefix}.k_norm.weight": (head_dim,)})
        if config.get("attention_bias"):
            out.update({f"{prefix}.{p}_proj.bias": (n,) for p, n in (("q", q), ("k", kv), ("v", kv), ("o", hidden))})
    return out


def _mlp(prefix: str, hidden: int, inner: int) -> dict[str, Shape]:
    return {
        f"{prefix}.gate_proj.weight": (inner, hidden),
        f"{prefix}.up_proj.weight": (inner, hidden),
        f"{prefix}.down_proj.weight": (hidden, inner),
    }


def num_experts(config: dict) -> int:
    """Routed experts (transformers 4 writes `num_experts`, 5 `num_local_experts`); 0 for a dense model."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def _is_moe_layer(config: dict, layer: int) -> bool:
    step = config.get("decoder_sparse_step") or 1
    return num_experts(config) > 0 and layer not in (config.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def expected_hf_tensors(config: dict) -> dict[str, Shape]:
    """{name: shape} of every tensor the checkpoint must hold (config.json as a dict; model_type supported)."""
    model_type = config["model_type"]
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    out: dict[str, Shape] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        out[f"{layer}.input_layernorm.weight"] = (hidden,)
        out[f"{layer}.post_attention_layernorm.weight"] = (hidden,)
        out.update(_attention(f"{layer}.self_attn", config, model_type))
        if _is_moe_layer(config, i):
            experts = num_experts(config)
            out[f"{layer}.mlp.gate.weight"] = (experts, hidden)
            for j in range(experts):
                out.update(_mlp(f"{layer}.mlp.experts.{j}", hidden, config["moe_intermediate_size"]))
        else:
            out.update(_mlp(f"{layer}.mlp", hidden, config["intermediate_size"]))
    return out


def tolerated_extra(name: str, config: dict) -> bool:
    """Tensors a checkpoint may hold that nothing reads: rotary caches, an lm_head kept next to tied embeddings."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.get("tie_word_embeddings"))
