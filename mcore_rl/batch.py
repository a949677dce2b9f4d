"""The training batch of one RL step: rollout results packed into padded tensors, then split.

The global batch (every prompt x every sample) is the same on every rank. It is split into
mini-batches (one optimizer step each), each mini-batch over data-parallel ranks, each rank's share
into micro-batches. Normalisation counts are taken from the unsplit mini-batch (`GlobalCounts`), so
the loss and gradient do not depend on the split.

Per-token tensors follow Megatron's label convention: column t holds quantities of token t + 1
(the token predicted from the prefix up to t).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from mcore_rl.algos import GlobalCounts
from mcore_rl.megatron.actor import MicroBatch
from mcore_rl.rollout.base import RolloutSample


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
    old_log_prob: Optional[torch.Tensor] = None  # [B, S], filled by the old-policy pass
    ref_log_prob: Optional[torch.Tensor] = None
    routed_experts: Optional[list] = None  # per sequence [T, layers, k] or None
    extras: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def rows(self, index: torch.Tensor | slice) -> "RolloutBatch":
        pick = lambda t: None if t is None else t[index]
        routes = None
        if self.routed_experts is not None:
            ids = range(self.size)[index] if isinstance(index, slice) else index.tolist()
            routes = [self.routed_experts[i] for i in ids]
        return RolloutBatch(
            self.tokens[index],
            self.loss_mask[index],
            self.rollout_log_prob[index],
            self.advantages[index],
            self.rewards[index],
            self.response_lengths[index],
            self.prompt_lengths[index],
            pick(self.old_log_prob),
            pick(self.ref_log_prob),
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


def split_for_rank(
    batch: RolloutBatch,
    num_mini_batches: int,
    dp_size: int,
    dp_rank: int,
    micro_batch_size: int,
    max_len: Optional[int] = None,
    pack_routes_for_experts: Optional[int] = None,
) -> list[tuple[GlobalCounts, list[MicroBatch]]]:
    """For each mini-batch: its global counts and this DP rank's micro-batches.

    max_len: the Dr.GRPO denominator L_max (the configured generation length keeps it constant).
    pack_routes_for_experts: the model's expert count, to pack the engine's routes (rollout routing
    replay) into `routed_experts` [b, s, layers, k] / `route_valid` [b, s] extras.
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
        counts = GlobalCounts.from_mask(mini.loss_mask, max_len=max_len)
        mine = mini.rows(slice(dp_rank * per_rank, (dp_rank + 1) * per_rank))
        micro = []
        for start in range(0, per_rank, micro_batch_size):
            part = mine.rows(slice(start, start + micro_batch_size))
            extras = {
                "loss_mask": part.loss_mask,
                "advantages": part.advantages,
                "rollout_log_prob": part.rollout_log_prob,
            }
            if part.old_log_prob is not None:
                extras["old_log_prob"] = part.old_log_prob
            if part.ref_log_prob is not None:
                extras["ref_log_prob"] = part.ref_log_prob
            if pack_routes_for_experts is not None:
                from mcore_rl.megatron.routing_replay import pack_rollout_routes

                if part.routed_experts is None:
                    raise ValueError(
                        "algo.routing_replay=r3 needs the experts the engine chose, but this engine "
                        "returned none (vLLM returns them only on GPU/NPU): use r2 or the embedded engine"
                    )
                extras["routed_experts"], extras["route_valid"] = pack_rollout_routes(
                    part.routed_experts, part.tokens.shape[1], pack_routes_for_experts
                )
            micro.append(MicroBatch(tokens=part.tokens, extras=extras))
        out.append((counts, micro))
    return out
