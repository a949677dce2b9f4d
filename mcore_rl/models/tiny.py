"""A tiny Qwen3-MoE checkpoint and character-level tokenizer that the project builds itself (no hub).

Shaped so that every engine here can serve it: head_dim 32 (vLLM's CPU attention needs >= 32),
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


def build_hf_config(shape: TinyModelShape = TinyModelShape()):
    from transformers import Qwen3MoeConfig

    vocab = {tok: i for i, tok in enumerate(_vocab())}
    kwargs = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.moe_intermediate_size * 2,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        moe_intermediate_size=shape.moe_intermediate_size,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        pad_token_id=vocab[PAD_TOKEN],
        bos_token_id=vocab[IM_START],
        eos_token_id=vocab[IM_END],
        architectures=["Qwen3MoeForCausalLM"],
    )
    # transformers >= 5 keeps rope settings in rope_parameters; 4.x reads rope_theta (compat.transformers).
    config = Qwen3MoeConfig(**compat_transformers.rope_config_kwargs(shape.rope_theta), **kwargs)
    if getattr(config, "rope_theta", None) is None:
        config.rope_theta = shape.rope_theta  # read by mbridge and by vLLM builds pinned to transformers 4.x
    config.head_dim = shape.head_dim
    return config


def make_tiny_checkpoint(out_dir: str | os.PathLike, seed: int = 0, shape: TinyModelShape = TinyModelShape()) -> Path:
    """Write config.json, model.safetensors, tokenizer files and generation_config.json to out_dir.

    Deterministic: the same seed gives bit-identical weights.
    """
    import torch
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = build_hf_config(shape)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out)
    GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id
    ).save_pretrained(out)
    meta = {
        "maker": "mcore_rl.models.tiny",
        "seed": seed,
        "shape": shape.__dict__,
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    (out / "mcore_rl_tiny.json").write_text(json.dumps(meta, indent=2))
    return out
