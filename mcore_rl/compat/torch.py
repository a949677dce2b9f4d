"""torch version differences (supported: 2.7 - 2.13; see docs/versions.md).

* gloo `reduce_scatter` (torch < 2.8): `ProcessGroupGloo` has `reduce_scatter_tensor` (equal chunks) but not
  the list form `torch.distributed.reduce_scatter(output, input_list)`, which raises "ProcessGroupGloo does
  not support reduce_scatter"; torch 2.8 added it. megatron-core's alltoall token dispatcher calls the list
  form when the experts' tensor-parallel split of the tokens is uneven (TP > 1 with sequence parallel), so
  on CPU with torch 2.7 (Ascend's torch version) every such MoE forward fails. The shim reduces CPU tensors
  with one `all_reduce` of all chunks padded to the longest and copies out the rank's own rows: the same
  reduction of the same elements (padding rows never read), at world-size times the traffic, which the
  CPU runs can afford. Device tensors (nccl, hccl) and async calls go to torch's own function unchanged.
"""

from __future__ import annotations

import functools
from typing import Optional

from packaging.version import Version

from mcore_rl.compat import Shim, at_least, installed_version

_DISTRIBUTION = "torch"


def version() -> Optional[Version]:
    """The installed torch version (None when absent)."""
    return installed_version(_DISTRIBUTION)


def gloo_lacks_reduce_scatter() -> bool:
    """gloo has no list-form reduce_scatter (torch < 2.8)."""
    return version() is not None and not at_least(_DISTRIBUTION, "2.8")


_REDUCE_SCATTER = Shim(
    "gloo reduce_scatter",
    "torch < 2.8 on CPU",
    "gloo has no list-form reduce_scatter (megatron's MoE dispatcher, uneven TP splits): a padded all_reduce",
)


def shims() -> list[Shim]:
    return [_REDUCE_SCATTER] if gloo_lacks_reduce_scatter() else []


def reduce_scatter_padded(output, input_list, op=None, group=None) -> None:
    """`output` = the reduction (`op`, default sum) over the group of every rank's `input_list[rank]`, for
    chunks of any first-dimension sizes: one all_reduce of the chunks padded to the longest, then this
    rank's rows. (Not gloo's 2.7 `reduce_scatter_tensor`: it sums whatever `op` is asked.)"""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    longest = max(t.shape[0] for t in input_list)
    padded = input_list[0].new_zeros((len(input_list), longest, *input_list[0].shape[1:]))
    for i, chunk in enumerate(input_list):
        padded[i, : chunk.shape[0]].copy_(chunk)
    dist.all_reduce(padded, op=dist.ReduceOp.SUM if op is None else op, group=group)
    output.copy_(padded[rank, : input_list[rank].shape[0]])


def apply_shims() -> None:
    """Install the shims the installed torch needs (see the module docstring). Idempotent."""
    if not gloo_lacks_reduce_scatter():
        return
    import torch.distributed as dist

    original = dist.reduce_scatter
    if getattr(original, "_mcore_rl_compat_shim", False):
        return

    @functools.wraps(original)
    def reduce_scatter(output, input_list, op=None, group=None, async_op=False):
        if output.device.type == "cpu" and not async_op:
            return reduce_scatter_padded(output, input_list, op=op, group=group)
        return original(output, input_list, op=dist.ReduceOp.SUM if op is None else op, group=group, async_op=async_op)

    reduce_scatter._mcore_rl_compat_shim = True
    dist.reduce_scatter = reduce_scatter
