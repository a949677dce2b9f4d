"""Per-segment attention of a packed row (mcore_rl/models/segment_attention.py) against a plain-torch
reference: each segment's causal attention computed on its own with an explicit softmax, outputs and gradients.
The end-to-end check (packed micro-batches through the actor against padded ones) is in the layout-invariance
jobs (tests/test_layout_invariance.py)."""

import math

import pytest
import torch

from mcore_rl.megatron.attention_inputs import cu_seqlens
from mcore_rl.models.segment_attention import is_segment_bounds, segment_causal_attention, segment_index


def reference(query, key, value, lengths, scale):
    """Each segment alone: scores, causal -inf, softmax, weighted values; [T, 1, heads * d]."""
    heads, groups = query.shape[2], key.shape[2]
    outs, start = [], 0
    for n in lengths:
        q = query[start : start + n, 0].transpose(0, 1)  # [heads, n, d]
        k = key[start : start + n, 0].transpose(0, 1).repeat_interleave(heads // groups, dim=0)
        v = value[start : start + n, 0].transpose(0, 1).repeat_interleave(heads // groups, dim=0)
        scores = q @ k.transpose(1, 2) * scale
        future = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        outs.append((probs @ v).transpose(0, 1).reshape(n, -1))
        start += n
    return torch.cat(outs).unsqueeze(1)


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (6, 1)])
def test_segments_match_each_sequence_attended_alone(heads, groups):
    torch.manual_seed(0)
    lengths = [7, 1, 12, 3, 5]  # the last one plays the trailing padding segment: it too attends only to itself
    tokens, dim = sum(lengths), 8
    query = torch.randn(tokens, 1, heads, dim, dtype=torch.float64, requires_grad=True)
    key = torch.randn(tokens, 1, groups, dim, dtype=torch.float64, requires_grad=True)
    value = torch.randn(tokens, 1, groups, dim, dtype=torch.float64, requires_grad=True)
    scale = 1 / math.sqrt(dim)
    weight = torch.randn(tokens, 1, heads * dim, dtype=torch.float64)

    got = segment_causal_attention(query, key, value, cu_seqlens(lengths, "cpu"), scale, dropout=0.0)
    grads = torch.autograd.grad((got * weight).sum(), (query, key, value))
    want = reference(query, key, value, lengths, scale)
    want_grads = torch.autograd.grad((want * weight).sum(), (query, key, value))

    assert got.shape == (tokens, 1, heads * dim)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_segment_index_points_at_each_segment_then_pads():
    index, valid = segment_index(cu_seqlens([2, 3, 1], "cpu"))
    assert index.tolist() == [[0, 1, 0], [2, 3, 4], [5, 0, 0]]
    assert valid.tolist() == [[True, True, False], [True, True, True], [True, False, False]]


def test_only_int32_bounds_take_the_segment_path():
    assert is_segment_bounds(cu_seqlens([3, 4], "cpu"))
    assert not is_segment_bounds(None)
    assert not is_segment_bounds(torch.zeros(1, 1, 4, 4, dtype=torch.bool))  # Megatron's padded mask
    assert not is_segment_bounds(torch.tensor([0, 3, 7]))  # int64: not ours


def test_bounds_must_cover_the_row():
    q = torch.zeros(6, 1, 2, 4)
    with pytest.raises(ValueError, match="segment bounds end at 5 but the row has 6 tokens"):
        segment_causal_attention(q, q, q, cu_seqlens([2, 3], "cpu"), 0.5, 0.0)
    with pytest.raises(ValueError, match="one row"):
        segment_causal_attention(
            torch.zeros(5, 2, 2, 4),
            torch.zeros(5, 2, 2, 4),
            torch.zeros(5, 2, 2, 4),
            cu_seqlens([2, 3], "cpu"),
            0.5,
            0.0,
        )
