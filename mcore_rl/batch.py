"""The training data of one RL step, as typed containers: rollouts -> padded batch -> mini-batches -> micro-batches.

The global batch (every prompt x every sample) is the same on every rank. It is split into
mini-batches (one optimizer step each), each mini-batch over data-parallel ranks, each rank's share
into micro-batches. Normalisation counts are taken from the unsplit mini-batch (`GlobalCounts`), so
the loss and gradient do not depend on the split.

Per-token tensors follow Megatron's label convention: column t holds quantities of token t + 1
(the token predicted from the prefix up to t); so `loss_mask[:, -1]` is always 0.
Routes (`routed_experts`) are the exception: row t holds the experts of token t itself.

`mcore_rl.megatron` consumes these containers; this module imports nothing from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from mcore_rl.algos import GlobalCounts
from mcore_rl.rollout.base import RolloutSample

ROUTE_DTYPE = torch.int16  # expert ids < 32768; uint8 would halve it for <= 256 experts


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
    # Routes the update replays (R2: recorded by the old-policy pass; R3: from routed_experts), in the
    # actor's router order: a mcore_rl.megatron.routing_replay.MicroBatchRoutes, set by the actor.
    replay_routes: Optional[Any] = None
    position_ids: Optional[torch.Tensor] = None  # [b, s]; default 0..s-1
    attention_mask: Optional[torch.Tensor] = None  # None: causal (Megatron's default)

    def __post_init__(self):
        if self.tokens.dim() != 2:
            raise ValueError(f"MicroBatch.tokens must be [batch, seq], got shape {tuple(self.tokens.shape)}")
        shape = tuple(self.tokens.shape)
        for name in (
            "loss_mask",
            "advantages",
            "rollout_log_prob",
            "old_log_prob",
            "ref_log_prob",
            "entropy",
            "route_valid",
            "position_ids",
        ):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(
                    f"MicroBatch.{name} has shape {tuple(value.shape)}, tokens {shape}: all are [batch, seq]"
                )
        if self.routed_experts is not None and tuple(self.routed_experts.shape[:2]) != shape:
            raise ValueError(
                f"MicroBatch.routed_experts has shape {tuple(self.routed_experts.shape)}, expected {shape} + (layers, k)"
            )
        if self.loss_mask is not None and bool(self.loss_mask[:, -1].any()):
            raise ValueError(
                "loss_mask[:, -1] is set, but the last position has no next token: shift the response mask "
                "left by one so that position t marks tokens[:, t + 1]"
            )
        if self.position_ids is None:
            b, s = shape
            self.position_ids = torch.arange(s, device=self.tokens.device).unsqueeze(0).expand(b, s)

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

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def rows(self, index: slice) -> "RolloutBatch":
        routes = None if self.routed_experts is None else self.routed_experts[index]
        return RolloutBatch(
            self.tokens[index],
            self.loss_mask[index],
            self.rollout_log_prob[index],
            self.advantages[index],
            self.rewards[index],
            self.response_lengths[index],
            self.prompt_lengths[index],
            routes,
        )


def pack_rollouts(
    samples: list[RolloutSample], rewards: torch.Tensor, advantages: torch.Tensor, pad_id: int, multiple: int = 8
) -> RolloutBatch:
    """Pack samples (in group order) into right-padded tensors; S is rounded up to `multiple`."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    seq_len = -(-max(lengths) // multiple) * multiple
    batch = len(samples)
    tokens = torch.full((batch, seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros(batch, seq_len)
    rollout_lp = torch.zeros(batch, seq_len)
    adv = torch.zeros(batch, seq_len)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        tokens[i, :p] = torch.tensor(s.prompt_ids)
        tokens[i, p : p + r] = torch.tensor(s.response_ids, dtype=torch.long)
        # response token j sits at column p + j and is predicted at column p + j - 1
        mask[i, p - 1 : p + r - 1] = 1.0
        rollout_lp[i, p - 1 : p + r - 1] = s.logprobs.float()
        adv[i, p - 1 : p + r - 1] = float(advantages[i])
    routes = [s.routed_experts for s in samples]
    return RolloutBatch(
        tokens=tokens,
        loss_mask=mask,
        rollout_log_prob=rollout_lp,
        advantages=adv,
        rewards=rewards.float(),
        response_lengths=torch.tensor([len(s.response_ids) for s in samples]),
        prompt_lengths=torch.tensor([len(s.prompt_ids) for s in samples]),
        routed_experts=routes if all(r is not None for r in routes) else None,
    )


def pack_rollout_routes(
    per_sequence: list[torch.Tensor], seq_len: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Engine routes of b sequences ([T_i, layers, k] each) -> ([b, seq_len, layers, k] ids, [b, seq_len] valid).

    Positions past T_i (right padding) get k distinct dummy experts, spread over the experts so padding
    neither duplicates an id in a token (dispatch needs distinct ids) nor piles onto one expert."""
    if not per_sequence:
        raise ValueError("pack_rollout_routes: no sequences given")
    _, num_layers, k = per_sequence[0].shape
    if k > num_experts:
        raise ValueError(f"pack_rollout_routes: top-k {k} > num_experts {num_experts}")
    b = len(per_sequence)
    positions = torch.arange(seq_len)
    dummy = (positions[:, None, None] * k + torch.arange(k)) % num_experts  # [s, 1, k], distinct within a row
    ids = dummy.expand(seq_len, num_layers, k).repeat(b, 1, 1, 1).to(ROUTE_DTYPE)
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
        if part.routed_experts is None:
            raise ValueError(
                "algo.routing_replay=r3 needs the experts the engine chose, but this engine returned none "
                "(the embedded engine records them; vLLM only where it can return routed experts): use r2 "
                "or the embedded engine"
            )
        routes, valid = pack_rollout_routes(part.routed_experts, part.tokens.shape[1], route_experts)
    return MicroBatch(
        tokens=part.tokens,
        loss_mask=part.loss_mask,
        advantages=part.advantages,
        rollout_log_prob=part.rollout_log_prob,
        routed_experts=routes,
        route_valid=valid,
    )


def split_for_rank(
    batch: RolloutBatch,
    num_mini_batches: int,
    dp_size: int,
    dp_rank: int,
    micro_batch_size: int,
    max_len: Optional[int] = None,
    route_experts: Optional[int] = None,
) -> list[MiniBatch]:
    """For each mini-batch: its global counts and this DP rank's micro-batches.

    max_len: the Dr.GRPO denominator L_max (the configured generation length keeps it constant).
    route_experts: the model's expert count, to pack the engine's routes (rollout routing replay, R3)
    into each micro-batch's `routed_experts` / `route_valid`.
    """
    per_mini, rest = divmod(batch.size, num_mini_batches)
    per_rank, rest2 = divmod(per_mini, dp_size)
    if rest or rest2 or per_rank % micro_batch_size:
        raise ValueError(
            f"global batch of {batch.size} sequences does not split into {num_mini_batches} mini-batches x "
            f"{dp_size} data-parallel ranks x micro-batches of {micro_batch_size}: choose data.prompts_per_step x "
            f"rollout.n divisible by algo.mini_batches x dp x actor.parallel.micro_batch_size"
        )
    out = []
    for m in range(num_mini_batches):
        mini = batch.rows(slice(m * per_mini, (m + 1) * per_mini))
        mine = mini.rows(slice(dp_rank * per_rank, (dp_rank + 1) * per_rank))
        micro = [
            _micro_batch(mine.rows(slice(start, start + micro_batch_size)), route_experts)
            for start in range(0, per_rank, micro_batch_size)
        ]
        out.append(MiniBatch(GlobalCounts.from_mask(mini.loss_mask, max_len=max_len), micro))
    return out
