"""Tiny checkpoints and a character-level tokenizer that the project builds itself (no hub).

Three architectures, each shaped like its real model where it matters to the code paths:
  qwen3-moe  Qwen3MoeForCausalLM: QK-norm, 8 experts top-2, untied embeddings (as Qwen3-30B-A3B)
  qwen3      Qwen3ForCausalLM (dense): QK-norm, untied embeddings (as Qwen3-8B)
  qwen2      Qwen2ForCausalLM (dense): q/k/v biases, no QK-norm, TIED embeddings (as Qwen2.5-3B: the checkpoint
             holds `model.embed_tokens.weight` and no `lm_head.weight`)
Shaped so that every engine here can serve them: head_dim 32 (vLLM's CPU attention needs >= 32),
vocabulary 128 (divisible by TP 1/2/4/8, so Megatron needs no vocabulary padding), 8 experts top-2
(EP 1/2/4/8 all divide it), 4 query heads in 2 KV groups (TP 1/2).
"""

from __future__ import annotations

import json
import os
import string
from dataclasses import dataclass
from pathlib import Path

from mcore_rl.compat import transformers as compat_transformers

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # end-of-turn: generation stops here
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
VOCAB_SIZE = 128
ARCHS = ("qwen3-moe", "qwen3", "qwen2")  # make-tiny --arch; the first is the default

# Qwen-style chat template: the same markup the real Qwen3 tokenizer uses, minus tool calls.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyModelShape:
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    intermediate_size: int = 128  # dense MLP (qwen3 / qwen2)


def _vocab() -> list[str]:
    chars = list("\n ") + list(string.digits) + list(string.ascii_lowercase) + list(string.ascii_uppercase)
    chars += [c for c in string.punctuation]
    vocab = SPECIAL_TOKENS + chars
    assert len(vocab) <= VOCAB_SIZE, len(vocab)
    vocab += [f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - len(vocab))]
    return vocab


def build_tokenizer():
    """A character-level fast tokenizer with a chat template and <|im_end|> as end-of-turn."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_vocab())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD_TOKEN))
    # Every character is its own token; special tokens are matched first as added tokens.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        model_max_length=TinyModelShape.max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}: use one of {', '.join(ARCHS)}")


def build_hf_config(shape: TinyModelShape = TinyModelShape(), arch: str = "qwen3-moe"):
    """The transformers config of a tiny `arch` model (see the module docstring)."""
    from transformers import Qwen2Config, Qwen3Config, Qwen3MoeConfig

    _check_arch(arch)
    vocab = {tok: i for i, tok in enumerate(_vocab())}
    kwargs = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        pad_token_id=vocab[PAD_TOKEN],
        bos_token_id=vocab[IM_START],
        eos_token_id=vocab[IM_END],
    )
    if arch == "qwen3-moe":
        cls = Qwen3MoeConfig
        kwargs.update(
            intermediate_size=shape.moe_intermediate_size * 2,
            head_dim=shape.head_dim,
            num_experts=shape.num_experts,
            num_experts_per_tok=shape.num_experts_per_tok,
            moe_intermediate_size=shape.moe_intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            tie_word_embeddings=False,
            architectures=["Qwen3MoeForCausalLM"],
        )
    elif arch == "qwen3":
        cls = Qwen3Config
        kwargs.update(
            intermediate_size=shape.intermediate_size,
            head_dim=shape.head_dim,
            tie_word_embeddings=False,
            architectures=["Qwen3ForCausalLM"],
        )
    else:  # qwen2: head_dim is hidden / heads (Qwen2 has no head_dim setting), so hidden = heads * head_dim
        cls = Qwen2Config
        kwargs.update(
            hidden_size=shape.num_attention_heads * shape.head_dim,
            intermediate_size=shape.intermediate_size,
            tie_word_embeddings=True,
            use_sliding_window=False,
            architectures=["Qwen2ForCausalLM"],
        )
    # transformers >= 5 keeps rope settings in rope_parameters; 4.x reads rope_theta (compat.transformers).
    config = cls(**compat_transformers.rope_config_kwargs(shape.rope_theta), **kwargs)
    if getattr(config, "rope_theta", None) is None:
        config.rope_theta = shape.rope_theta  # read by mbridge and by vLLM builds pinned to transformers 4.x
    if arch != "qwen2":
        config.head_dim = shape.head_dim
    return config


def _model_class(arch: str):
    from transformers import Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    return {"qwen3-moe": Qwen3MoeForCausalLM, "qwen3": Qwen3ForCausalLM, "qwen2": Qwen2ForCausalLM}[arch]


def _spread_norms_and_biases(model) -> None:
    """Give norm weights and biases distinct values (transformers initialises them to ones / zeros), so that a
    mixed-up norm (input vs pre-MLP, q vs k) or a misplaced q/k/v bias changes the logits and tests catch it."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.normal_(1.0, 0.1)


def make_tiny_checkpoint(
    out_dir: str | os.PathLike, seed: int = 0, shape: TinyModelShape = TinyModelShape(), arch: str = "qwen3-moe"
) -> Path:
    """Write config.json, model.safetensors, tokenizer files and generation_config.json to out_dir.

    Deterministic: the same seed and arch give bit-identical weights.
    """
    import torch
    from transformers import GenerationConfig

    _check_arch(arch)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = build_hf_config(shape, arch)
    torch.manual_seed(seed)
    model = _model_class(arch)(config).to(torch.float32)
    if arch != "qwen3-moe":
        _spread_norms_and_biases(model)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out)
    GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id
    ).save_pretrained(out)
    meta = {
        "maker": "mcore_rl.models.tiny",
        "arch": arch,
        "seed": seed,
        "shape": shape.__dict__,
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    (out / "mcore_rl_tiny.json").write_text(json.dumps(meta, indent=2))
    return out
