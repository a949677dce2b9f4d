"""The training data of one RL step, as typed containers: rollouts -> padded batch -> mini-batches -> micro-batches.

The global batch (every prompt x every sample) is the same on every rank. It is split into
mini-batches (one optimizer step each), each mini-batch over data-parallel ranks, each rank's share
into micro-batches. Normalisation counts are taken from the unsplit mini-batch (`GlobalCounts`), so
the loss and gradient do not depend on the split.

Per-token tensors follow Megatron's label convention: column t holds quantities of token t + 1
(the token predicted from the prefix up to t); so `loss_mask[:, -1]` is 0 unless the targets are given
(`MicroBatch.labels`: a context-parallel rank's part of the sequences, whose last token may be mid-response).
Routes (`routed_experts`) are the exception: row t holds the experts of token t itself.

Two ways to cut a rank's share into micro-batches (`split_for_rank`):
  * fixed size (`micro_batch_size` sequences, right-padded to the longest sequence of the global batch);
  * token budget (`max_tokens`, actor.max_tokens_per_micro_batch): `partition_by_tokens` balances the
    data-parallel shares by tokens and cuts each share into micro-batches under the budget, and every
    micro-batch is PACKED: its sequences concatenated in one row [1, T] (T = their total length padded
    to the layout's multiple), position ids restarting per sequence, `seq_lengths` naming the segments
    (the actor confines attention to each segment). Per-token fields are packed the same way and keep
    the label convention inside each segment; the last position of a segment is never marked (it would
    predict the next segment's first token). Outputs of forward passes stay in this packed alignment
    (`unpack_rows` cuts one back into per-sequence pieces).

`mcore_rl.megatron` consumes these containers and the engines (`mcore_rl.rollout`) produce `RolloutSample`; this
module imports nothing from either.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from mcore_rl.algos import GlobalCounts
from mcore_rl.preflight.run import check_step_split

ROUTE_DTYPE = torch.int16  # expert ids < 32768; uint8 would halve it for <= 256 experts
# the per-token [b, s] fields of a MicroBatch the passes read or fill, beside the tokens (one list: the shape check
# here and the context-parallel split, mcore_rl/megatron/context_parallel.py)
TOKEN_FIELDS = (
    "loss_mask",
    "advantages",
    "rollout_log_prob",
    "old_log_prob",
    "ref_log_prob",
    "entropy",
    "route_valid",
    "version_lag",
)


def next_token_targets(tokens: torch.Tensor) -> torch.Tensor:
    """targets[:, t] = tokens[:, t + 1]; the last column has no next token (a placeholder that must be masked)."""
    return torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)


@dataclass
class RolloutSample:
    """One response to one prompt."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: (
        torch.Tensor
    )  # [len(response_ids)] float32, log-prob of each sampled token under the sampling distribution
    finish_reason: str  # "stop" (hit a stop token) | "length" (max_new_tokens)
    # [len(prompt_ids) + len(response_ids), num_moe_layers, top_k] int16 expert ids the router chose for every
    # token of the sequence (prompt too: replaying routes in training needs them for every position), or None
    # where the engine cannot capture them.
    routed_experts: Optional[torch.Tensor] = None
    # the weight version that generated each response token (0: the initial weights, k: after step k's update): a
    # sequence continued across a weight update spans versions; None: every token has its step's version
    token_versions: Optional[list[int]] = None

    def __post_init__(self):
        if self.token_versions is not None and len(self.token_versions) != len(self.response_ids):
            raise ValueError(
                f"RolloutSample.token_versions has {len(self.token_versions)} versions for "
                f"{len(self.response_ids)} response tokens: one per token, or None"
            )


@dataclass
class MicroBatch:
    """`b` right-padded sequences of length `s` and the per-token tensors the passes read or fill.

    Every per-token field is [b, s] (routes: [b, s, moe_layers, k]) aligned as the module docstring says;
    None where a pass does not need it. The trainer fills `old_log_prob` / `ref_log_prob` / `entropy`
    from the actor's forward passes.
    """

    tokens: torch.Tensor  # [b, s] long
    loss_mask: Optional[torch.Tensor] = None  # float: 1 where tokens[:, t + 1] is a response token
    advantages: Optional[torch.Tensor] = None  # the sequence advantage broadcast over its tokens
    rollout_log_prob: Optional[torch.Tensor] = None  # the engine's log-prob of the sampled token
    old_log_prob: Optional[torch.Tensor] = None  # the policy before this step's updates
    ref_log_prob: Optional[torch.Tensor] = None  # the frozen reference policy (KL)
    entropy: Optional[torch.Tensor] = None  # of the old policy, for metrics
    routed_experts: Optional[torch.Tensor] = None  # [b, s, moe_layers, k] the engine's experts per token (R3)
    route_valid: Optional[torch.Tensor] = None  # [b, s] bool: real tokens of routed_experts
    # [b, s] float: weight versions between each token's behaviour policy and the update's starting weights
    version_lag: Optional[torch.Tensor] = None
    # Routes the update replays (R2: recorded by the old-policy pass; R3: from routed_experts), in the
    # actor's router order: a mcore_rl.megatron.routing_replay.MicroBatchRoutes, set by the actor.
    replay_routes: Optional[Any] = None
    position_ids: Optional[torch.Tensor] = None  # [b, s]; default 0..s-1
    # [b, s] the token each position predicts; None: tokens shifted left by one (`next_token_targets`). Set by
    # the context-parallel split (mcore_rl/megatron/context_parallel.py), which takes the targets before cutting.
    labels: Optional[torch.Tensor] = None
    attention_mask: Optional[torch.Tensor] = None  # None: causal (Megatron's default)
    # Packed micro-batch (b = 1): lengths of the segments of the row, in order, summing to s; the last
    # one may be padding. None: b right-padded sequences. Attention never crosses a segment boundary.
    seq_lengths: Optional[list[int]] = None
    # Packed: the row of the padded batch it was cut from (the mini-batch's row index) of each sequence segment.
    source_rows: Optional[list[int]] = None

    def __post_init__(self):
        if self.tokens.dim() != 2:
            raise ValueError(f"MicroBatch.tokens must be [batch, seq], got shape {tuple(self.tokens.shape)}")
        shape = tuple(self.tokens.shape)
        for name in (*TOKEN_FIELDS, "position_ids", "labels"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(
                    f"MicroBatch.{name} has shape {tuple(value.shape)}, tokens {shape}: all are [batch, seq]"
                )
        if self.routed_experts is not None and tuple(self.routed_experts.shape[:2]) != shape:
            raise ValueError(
                f"MicroBatch.routed_experts has shape {tuple(self.routed_experts.shape)}, expected {shape} + (layers, k)"
            )
        # Only the shifted tokens leave the last position without a target: a context-parallel rank's row (labels
        # taken before the split) ends inside a sequence, often inside its response.
        if self.labels is None and self.loss_mask is not None and bool(self.loss_mask[:, -1].any()):
            raise ValueError(
                "loss_mask[:, -1] is set, but the last position has no next token: shift the response mask "
                "left by one so that position t marks tokens[:, t + 1]"
            )
        if self.seq_lengths is not None and (shape[0] != 1 or sum(self.seq_lengths) != shape[1]):
            raise ValueError(
                f"packed MicroBatch: tokens {shape} must be one row whose length equals sum(seq_lengths) = "
                f"{sum(self.seq_lengths)}"
            )
        if self.position_ids is None:
            b, s = shape
            if self.seq_lengths is not None:
                self.position_ids = torch.cat([torch.arange(n) for n in self.seq_lengths]).unsqueeze(0)
                self.position_ids = self.position_ids.to(self.tokens.device)
            else:
                self.position_ids = torch.arange(s, device=self.tokens.device).unsqueeze(0).expand(b, s)

    @property
    def packed(self) -> bool:
        return self.seq_lengths is not None

    def targets(self) -> torch.Tensor:
        """[b, s] the next token at each position (`labels`, else the tokens shifted left by one)."""
        return self.labels if self.labels is not None else next_token_targets(self.tokens)

    @property
    def num_tokens(self) -> int:
        """Tokens the model computes for this micro-batch (padding included)."""
        return self.tokens.numel()

    def to(self, device) -> "MicroBatch":
        """A copy with every tensor on `device`."""
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=True)
            for f in dataclasses.fields(self)
            if torch.is_tensor(getattr(self, f.name))
        }
        return dataclasses.replace(self, **moved)

    def require(self, *names: str) -> None:
        """Raise naming the fields a pass needs that this micro-batch lacks."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"micro-batch lacks {missing}: fill them before this pass (see mcore_rl.batch)")


@dataclass
class MiniBatch:
    """One optimizer step: the global counts of the whole mini-batch and this rank's micro-batches."""

    counts: GlobalCounts
    micro_batches: list[MicroBatch]


@dataclass
class RolloutBatch:
    """B = prompts x samples sequences, right-padded to a common length S."""

    tokens: torch.Tensor  # [B, S] long, prompt + response, pad id after
    loss_mask: torch.Tensor  # [B, S] float: 1 where tokens[:, t + 1] is a response token
    rollout_log_prob: torch.Tensor  # [B, S] float, aligned like loss_mask
    advantages: torch.Tensor  # [B, S] float (the sequence advantage broadcast over its tokens)
    rewards: torch.Tensor  # [B]
    response_lengths: torch.Tensor  # [B]
    prompt_lengths: torch.Tensor  # [B]
    routed_experts: Optional[list] = None  # per sequence [T, layers, k] or None
    pad_id: int = 0
    version_lag: Optional[torch.Tensor] = None  # [B, S] float, aligned like loss_mask (MicroBatch.version_lag)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def lengths(self) -> list[int]:
        """Tokens of each sequence (prompt + response), without padding."""
        return (self.prompt_lengths + self.response_lengths).tolist()

    def rows(self, index: "slice | list[int]") -> "RolloutBatch":
        """The sequences at `index` (a slice, or a list of row numbers)."""
        routes = None
        if isinstance(index, list):
            routes = None if self.routed_experts is None else [self.routed_experts[i] for i in index]
            index = torch.tensor(index, dtype=torch.long)
        elif self.routed_experts is not None:
            routes = self.routed_experts[index]
        return RolloutBatch(
            self.tokens[index],
            self.loss_mask[index],
            self.rollout_log_prob[index],
            self.advantages[index],
            self.rewards[index],
            self.response_lengths[index],
            self.prompt_lengths[index],
            routes,
            self.pad_id,
            None if self.version_lag is None else self.version_lag[index],
        )


def pad_rollouts(
    samples: list[RolloutSample],
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    pad_id: int,
    multiple: int = 8,
    valid: Optional[torch.Tensor] = None,
    seq_len: Optional[int] = None,
    versions: Optional[tuple[int, int]] = None,
) -> RolloutBatch:
    """Pad samples (in group order) into right-padded tensors; S is the longest length rounded up to
    `multiple`, or `seq_len` (a rank padding part of a step pads like the whole step: `step_seq_len`).

    Samples whose `valid` flag is False (their reward failed) keep their tokens but get no loss-mask
    entries, so they add nothing to the loss nor to its token and sequence counts. `versions` (the update's
    starting weight version, the version of tokens without their own): fills `version_lag`."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    if seq_len is None:
        seq_len = step_seq_len(lengths, multiple)
    elif seq_len < max(lengths, default=0):
        raise ValueError(f"pad_rollouts: seq_len {seq_len} < the longest sequence ({max(lengths)} tokens)")
    batch = len(samples)
    tokens = torch.full((batch, seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros(batch, seq_len)
    rollout_lp = torch.zeros(batch, seq_len)
    adv = torch.zeros(batch, seq_len)
    lag = None if versions is None else torch.zeros(batch, seq_len)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        tokens[i, :p] = torch.tensor(s.prompt_ids)
        tokens[i, p : p + r] = torch.tensor(s.response_ids, dtype=torch.long)
        # response token j sits at column p + j and is predicted at column p + j - 1
        mask[i, p - 1 : p + r - 1] = 1.0 if valid is None or bool(valid[i]) else 0.0
        rollout_lp[i, p - 1 : p + r - 1] = s.logprobs.float()
        adv[i, p - 1 : p + r - 1] = float(advantages[i])
        if lag is not None:
            lag[i, p - 1 : p + r - 1] = versions[0] - torch.tensor(s.token_versions or [versions[1]] * r).float()
    routes = [s.routed_experts for s in samples]
    return RolloutBatch(
        tokens=tokens,
        loss_mask=mask,
        rollout_log_prob=rollout_lp,
        advantages=adv,
        rewards=rewards.float(),
        response_lengths=torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long),
        prompt_lengths=torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long),
        routed_experts=routes if all(r is not None for r in routes) else None,
        pad_id=pad_id,
        version_lag=lag,
    )


def step_seq_len(lengths: list[int], multiple: int) -> int:
    """The padded width S of a step whose sequences have `lengths` tokens: the longest, rounded up."""
    return _round_up(max(lengths, default=1), multiple)


def _dummy_routes(seq_len: int, num_layers: int, k: int, num_experts: int) -> torch.Tensor:
    """[seq_len, layers, k] ids for padding: k distinct experts per position, cycling over all experts."""
    positions = torch.arange(seq_len)
    dummy = (positions[:, None, None] * k + torch.arange(k)) % num_experts  # [s, 1, k], distinct within a row
    return dummy.expand(seq_len, num_layers, k).to(ROUTE_DTYPE)


def pad_rollout_routes(
    per_sequence: list[torch.Tensor], seq_len: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Engine routes of b sequences ([T_i, layers, k] each) -> ([b, seq_len, layers, k] ids, [b, seq_len] valid).

    Positions past T_i (right padding) get k distinct dummy experts, spread over the experts so padding
    neither duplicates an id in a token (dispatch needs distinct ids) nor piles onto one expert."""
    if not per_sequence:
        raise ValueError("pad_rollout_routes: no sequences given")
    _, num_layers, k = per_sequence[0].shape
    if k > num_experts:
        raise ValueError(f"pad_rollout_routes: top-k {k} > num_experts {num_experts}")
    b = len(per_sequence)
    ids = _dummy_routes(seq_len, num_layers, k, num_experts).repeat(b, 1, 1, 1)
    valid = torch.zeros(b, seq_len, dtype=torch.bool)
    for i, r in enumerate(per_sequence):
        if r.dim() != 3 or r.shape[1:] != (num_layers, k):
            raise ValueError(f"routes of sequence {i} have shape {tuple(r.shape)}, expected [T, {num_layers}, {k}]")
        if r.shape[0] > seq_len:
            raise ValueError(f"routes of sequence {i} cover {r.shape[0]} tokens > packed length {seq_len}")
        ids[i, : r.shape[0]] = r.to(ROUTE_DTYPE)
        valid[i, : r.shape[0]] = True
    return ids, valid


def _micro_batch(part: RolloutBatch, route_experts: Optional[int]) -> MicroBatch:
    routes = valid = None
    if route_experts is not None:
        _require_routes(part)
        routes, valid = pad_rollout_routes(part.routed_experts, part.tokens.shape[1], route_experts)
    return MicroBatch(
        tokens=part.tokens,
        loss_mask=part.loss_mask,
        advantages=part.advantages,
        rollout_log_prob=part.rollout_log_prob,
        routed_experts=routes,
        route_valid=valid,
        version_lag=part.version_lag,
    )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _lpt(items: list[int], sizes: list[int], bins: int) -> list[list[int]]:
    """Longest-processing-time greedy: items (largest size first, ties by index) each go to the bin with
    the fewest tokens so far (ties: fewest items, then lowest bin). Bins list their items in index order."""
    load = [(0, 0, b) for b in range(bins)]
    out: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(items, key=lambda i: (-sizes[i], i)):
        tokens, count, b = min(load)
        out[b].append(i)
        load[b] = (tokens + sizes[i], count + 1, b)
    return [sorted(b) for b in out]


def partition_by_tokens(lengths: list[int], dp_size: int, max_tokens: int, multiple: int = 1) -> list[list[list[int]]]:
    """Sequence indices of one mini-batch per data-parallel rank and micro-batch: [dp][micro] -> indices.

    DP shares: greedy LPT over sequence lengths (longest first, each to the rank with the fewest tokens),
    so shares differ by at most one sequence's length. Each share: LPT into k micro-batches, k the smallest
    count for which every rank's micro-batches fit `max_tokens` (a micro-batch costs its total length
    rounded up to `multiple`), the SAME k on every rank (with expert parallelism each micro-batch's
    all-to-all spans DP ranks); a rank with fewer sequences than k gets empty micro-batches. Pure and
    deterministic: every rank computes the same partition from the same lengths.
    """
    if max_tokens < 1 or dp_size < 1 or multiple < 1:
        raise ValueError(
            f"partition_by_tokens: max_tokens {max_tokens}, dp {dp_size}, multiple {multiple} must be >= 1"
        )
    longest = max(lengths, default=0)
    if _round_up(longest, multiple) > max_tokens:
        raise ValueError(
            f"a sequence of {longest} tokens (padded to {_round_up(longest, multiple)}) exceeds "
            f"actor.max_tokens_per_micro_batch = {max_tokens}: raise it to at least "
            f"data.max_prompt_len + rollout.max_new_tokens"
        )
    shares = _lpt(list(range(len(lengths))), lengths, dp_size)
    k = max(1, max(-(-sum(lengths[i] for i in share) // max_tokens) for share in shares))
    while True:
        parts = [_lpt(share, lengths, k) for share in shares]
        cost = max(_round_up(sum(lengths[i] for i in mb), multiple) for rank in parts for mb in rank)
        if cost <= max_tokens:
            return parts
        k += 1  # terminates: with one sequence per micro-batch every micro-batch fits


def pack_sequences(
    part: RolloutBatch, multiple: int, route_experts: Optional[int] = None, segment_lengths: Optional[list] = None
) -> MicroBatch:
    """The sequences of `part` concatenated in one row [1, T], T = total length rounded up to `multiple`
    (a trailing padding segment of pad ids, masked out). An empty `part` gives one padding segment
    of `multiple` tokens: a micro-batch that contributes nothing (loss mask 0) but runs every collective.
    `route_experts`: the model's expert count, to pack the engine's routes (R3) with dummy experts at pads."""
    lengths = part.lengths if part.size else []
    total = sum(lengths)
    row = _round_up(max(total, 1), multiple)
    seq_lengths = lengths + ([row - total] if row > total else [])
    tokens = torch.full((1, row), part.pad_id, dtype=torch.long)
    names = ("loss_mask", "advantages", "rollout_log_prob") + (("version_lag",) if part.version_lag is not None else ())
    fields = {name: torch.zeros(1, row) for name in names}
    start = 0
    for i, n in enumerate(lengths):
        tokens[0, start : start + n] = part.tokens[i, :n]
        for name, packed in fields.items():
            packed[0, start : start + n] = getattr(part, name)[i, :n]
        start += n
    routes = valid = None
    if route_experts is not None:
        routes, valid = _packed_routes(part, lengths, row, route_experts)
    return MicroBatch(tokens=tokens, routed_experts=routes, route_valid=valid, seq_lengths=seq_lengths, **fields)


def pack_token_lists(sequences: list[list[int]], multiple: int, pad_id: int = 0) -> MicroBatch:
    """Token lists in one packed row (no per-token fields): the forward-only probe's micro-batch."""
    lengths = [len(s) for s in sequences]
    row = _round_up(max(sum(lengths), 1), multiple)
    tail = [row - sum(lengths)] if row > sum(lengths) else []
    tokens = torch.tensor([t for s in sequences for t in s] + [pad_id] * sum(tail), dtype=torch.long)
    return MicroBatch(tokens=tokens.unsqueeze(0), seq_lengths=lengths + tail)


def _packed_routes(part: RolloutBatch, lengths: list[int], row: int, num_experts: int):
    """Engine routes of the packed sequences at their offsets in the row; dummy experts elsewhere."""
    if part.size == 0:  # a filler micro-batch: layer count and k are not known from it
        raise ValueError("_packed_routes: no sequences (the caller packs routes of filler micro-batches)")
    _require_routes(part)
    _, num_layers, k = part.routed_experts[0].shape
    ids, valid = pad_rollout_routes(part.routed_experts, max(lengths), num_experts)  # checks the shapes
    packed = _dummy_routes(row, num_layers, k, num_experts).unsqueeze(0).clone()
    packed_valid = torch.zeros(1, row, dtype=torch.bool)
    start = 0
    for i, n in enumerate(lengths):
        packed[0, start : start + n] = torch.where(valid[i, :n, None, None], ids[i, :n], packed[0, start : start + n])
        packed_valid[0, start : start + n] = valid[i, :n]
        start += n
    return packed, packed_valid


def merge_packed(micro_batches: list[MicroBatch], multiple: int, pad_id: int = 0) -> MicroBatch:
    """Tokens of consecutive packed micro-batches in one packed row (their segments kept as they are), for a
    forward-only pass under a larger token budget; no micro-batch: a filler of `multiple` pad tokens."""
    if not micro_batches:
        return MicroBatch(tokens=torch.full((1, multiple), pad_id, dtype=torch.long), seq_lengths=[multiple])
    if not all(mb.packed for mb in micro_batches):
        raise ValueError("merge_packed: every micro-batch must be packed (seq_lengths set)")
    tokens = torch.cat([mb.tokens for mb in micro_batches], dim=1)
    return MicroBatch(tokens=tokens, seq_lengths=[n for mb in micro_batches for n in mb.seq_lengths])


def forward_groups(micro_batches: list[MicroBatch], max_tokens: int) -> list[list[int]]:
    """Consecutive runs of micro-batches whose tokens together stay within `max_tokens` (greedy)."""
    groups: list[list[int]] = []
    total = max_tokens + 1
    for i, mb in enumerate(micro_batches):
        if total + mb.num_tokens > max_tokens:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += mb.num_tokens
    return groups


def pack_field(values: torch.Tensor, micro_batch: MicroBatch) -> torch.Tensor:
    """A per-token field of the padded mini-batch ([N, S], rows as in `micro_batch.source_rows`) in the
    packed micro-batch's alignment [1, T] (zeros on the padding segment)."""
    if not micro_batch.packed or micro_batch.source_rows is None:
        raise ValueError("pack_field: the micro-batch is not packed from a mini-batch (source_rows is None)")
    out = torch.zeros(1, micro_batch.tokens.shape[1], dtype=values.dtype)
    start = 0
    for row, n in zip(micro_batch.source_rows, micro_batch.seq_lengths):
        out[0, start : start + n] = values[row, :n]
        start += n
    return out


def unpack_rows(values: torch.Tensor, micro_batch: MicroBatch) -> list[torch.Tensor]:
    """A per-token output of a packed micro-batch ([1, T] or [c, 1, T]) -> one [..., n_i] piece per
    segment (the trailing padding segment included, if any)."""
    if not micro_batch.packed:
        raise ValueError("unpack_rows: the micro-batch is not packed (seq_lengths is None)")
    return list(values.split(micro_batch.seq_lengths, dim=-1))


def segment_rows(values: torch.Tensor, seq_lengths: list[int]) -> torch.Tensor:
    """A packed per-token tensor [..., 1, T] -> [..., n, L]: one right-padded row per segment (L the longest
    segment, zeros past each segment's end), differentiable. Per-sequence reductions (sequence ratios,
    seq-mean aggregation) then run on rows exactly as in the padded layout."""
    lengths = torch.tensor(seq_lengths, device=values.device)
    starts = lengths.cumsum(0) - lengths
    cols = torch.arange(max(seq_lengths), device=values.device)
    inside = cols[None] < lengths[:, None]
    index = (starts[:, None] + cols[None]).clamp(max=values.shape[-1] - 1)
    gathered = values[..., 0, :][..., index]
    return torch.where(inside, gathered, torch.zeros((), dtype=values.dtype, device=values.device))


def _require_routes(part: RolloutBatch) -> None:
    if part.routed_experts is None:
        raise ValueError(
            "algo.routing_replay=r3 needs the experts the engine chose, but this engine returned none "
            "(the embedded engine records them; vLLM only where it can return routed experts): use r2 "
            "or the embedded engine"
        )


@dataclass
class MiniBatchPlan:
    """Which sequences of one mini-batch each data-parallel rank trains on, in which micro-batches.

    Decided from lengths alone (every rank computes the same plan), before any token moves: the trainer
    sends each sequence only to the ranks that train on it (mcore_rl.step_data)."""

    counts: GlobalCounts  # of the whole mini-batch, all ranks
    start: int  # step index of the mini-batch's first sequence
    parts: list[list[list[int]]]  # [dp rank][micro-batch] -> sequence indices inside the mini-batch
    packed: bool  # token-budget micro-batches (packed rows) rather than fixed-size padded ones

    def rows(self, dp_rank: int) -> list[int]:
        """Step indices of the sequences data-parallel rank `dp_rank` trains on in this mini-batch, sorted."""
        return sorted(self.start + i for micro in self.parts[dp_rank] for i in micro)


def plan_mini_batches(
    lengths: list[int],
    loss_tokens: list[int],
    num_mini_batches: int,
    dp_size: int,
    micro_batch_size: Optional[int] = None,
    max_tokens: Optional[int] = None,
    multiple: int = 1,
    max_len: int = 1,
) -> list[MiniBatchPlan]:
    """The plan of every mini-batch of a step from per-sequence `lengths` (prompt + response tokens) and
    `loss_tokens` (response tokens that count in the loss: 0 for a sample whose reward failed).

    Either `micro_batch_size` (each rank a contiguous share, cut into fixed-size micro-batches) or
    `max_tokens` (shares balanced by tokens and cut under the budget: `partition_by_tokens`). The
    mini-batches are consecutive slices of the step. max_len: the Dr.GRPO denominator L_max."""
    if (micro_batch_size is None) == (max_tokens is None):
        raise ValueError("split_for_rank: give exactly one of micro_batch_size and max_tokens")
    check_step_split(len(lengths), num_mini_batches, dp_size, micro_batch_size)
    per_mini = len(lengths) // num_mini_batches
    plans = []
    for m in range(num_mini_batches):
        rows = slice(m * per_mini, (m + 1) * per_mini)
        counts = GlobalCounts.from_lengths(loss_tokens[rows], max_len)
        if max_tokens is None:
            parts = _fixed_parts(per_mini, dp_size, micro_batch_size)
        else:
            parts = partition_by_tokens(lengths[rows], dp_size, max_tokens, multiple)
        plans.append(MiniBatchPlan(counts, m * per_mini, parts, packed=max_tokens is not None))
    return plans


def _fixed_parts(size: int, dp_size: int, micro_batch_size: int) -> list[list[list[int]]]:
    per_rank = size // dp_size  # check_step_split made it whole, and a multiple of micro_batch_size
    return [
        [
            list(range(d * per_rank + s, d * per_rank + s + micro_batch_size))
            for s in range(0, per_rank, micro_batch_size)
        ]
        for d in range(dp_size)
    ]


def build_mini_batches(
    plans: list[MiniBatchPlan],
    dp_rank: int,
    rows: RolloutBatch,
    row_of: dict[int, int],
    route_experts: Optional[int] = None,
    route_shape: Optional[tuple[int, int]] = None,
    multiple: int = 1,
) -> list[MiniBatch]:
    """This data-parallel rank's micro-batches of every planned mini-batch, from `rows`: a RolloutBatch that
    holds (at least) the sequences the rank trains on, step index i at row `row_of[i]`. Fixed-size
    micro-batches keep `rows`' padded width (the step's longest sequence, so it must be padded like the whole
    step). route_experts: the model's expert count, to pack the engine's routes (R3); route_shape: their
    (moe layers, top-k), for the filler micro-batches of a rank with fewer sequences than micro-batches."""
    out = []
    for plan in plans:
        micro = []
        for indices in plan.parts[dp_rank]:
            part = rows.rows([row_of[plan.start + i] for i in indices])
            if not plan.packed:
                micro.append(_micro_batch(part, route_experts))
                continue
            mb = pack_sequences(part, multiple, route_experts if indices else None)
            mb.source_rows = list(indices)
            if route_experts is not None and not indices:  # filler: dummy experts everywhere, none valid
                if route_shape is None:
                    _require_routes(rows)
                    route_shape = tuple(rows.routed_experts[0].shape[1:])
                num_layers, k = route_shape
                mb.routed_experts = _dummy_routes(mb.tokens.shape[1], num_layers, k, route_experts).unsqueeze(0)
                mb.route_valid = torch.zeros_like(mb.tokens, dtype=torch.bool)
            micro.append(mb)
        out.append(MiniBatch(plan.counts, micro))
    return out


def split_for_rank(
    batch: RolloutBatch,
    num_mini_batches: int,
    dp_size: int,
    dp_rank: int,
    micro_batch_size: Optional[int] = None,
    max_len: Optional[int] = None,
    route_experts: Optional[int] = None,
    max_tokens: Optional[int] = None,
    multiple: int = 1,
) -> list[MiniBatch]:
    """For each mini-batch: its global counts and this DP rank's micro-batches, from the whole step's batch.

    Either `micro_batch_size` (fixed-size, right-padded micro-batches: the rows of the padded batch) or
    `max_tokens` (packed micro-batches under a token budget, see `partition_by_tokens`; `multiple` is
    the layout's sequence-length multiple). The mini-batches are consecutive slices of the global batch.
    max_len: the Dr.GRPO denominator L_max (the configured generation length keeps it constant; default:
    the batch's padded width). route_experts: the model's expert count, to pack the engine's routes
    (rollout routing replay, R3) into each micro-batch's `routed_experts` / `route_valid`.
    The same plan and builder as the trainer's per-rank path (`plan_mini_batches`, `build_mini_batches`).
    """
    loss_tokens = [int(n) for n in batch.loss_mask.sum(-1).tolist()]
    plans = plan_mini_batches(
        batch.lengths,
        loss_tokens,
        num_mini_batches,
        dp_size,
        micro_batch_size,
        max_tokens,
        multiple,
        batch.tokens.shape[1] if max_len is None else max_len,
    )
    return build_mini_batches(plans, dp_rank, batch, {i: i for i in range(batch.size)}, route_experts, None, multiple)
