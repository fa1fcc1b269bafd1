"""All ranks agree on a small number (a flag, a count) at the same point of the training loop.

Preemption, non-finite steps and the end of uneven data shards all need every rank to take the
same decision at the same step; a rank deciding alone leaves the others waiting in a collective.
The values travel over a gloo group: CPU tensors, so agreeing never waits on a GPU stream.
"""

from __future__ import annotations

import datetime
import functools

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@functools.cache
def _agreement_group(timeout_seconds: int) -> dist.ProcessGroup | None:
    """The default group when it already runs on gloo, else a gloo group over the same ranks (created once)."""
    if dist.get_backend() == "gloo":
        return None
    # new_group is collective: every rank reaches this line at the same point of the loop.
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_seconds))


def _all_reduce(value: float, dtype: torch.dtype, op: dist.ReduceOp, timeout_seconds: int) -> float | int:
    if world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=dtype)
    dist.all_reduce(tensor, op=op, group=_agreement_group(timeout_seconds))
    return tensor.item()


def agree_max(value: int, timeout_seconds: int) -> int:
    """The largest `value` over all ranks; every rank must call it at the same point."""
    return int(_all_reduce(value, torch.int64, dist.ReduceOp.MAX, timeout_seconds))


def agree_min(value: int, timeout_seconds: int) -> int:
    """The smallest `value` over all ranks; every rank must call it at the same point."""
    return -agree_max(-value, timeout_seconds)


def agree_sum(value: float, timeout_seconds: int) -> float:
    """The sum of `value` over all ranks, in float64; every rank must call it at the same point."""
    return float(_all_reduce(value, torch.float64, dist.ReduceOp.SUM, timeout_seconds))


def barrier(timeout_seconds: int) -> None:
    """Return once every rank has reached this call."""
    if world_size() > 1:
        dist.barrier(group=_agreement_group(timeout_seconds))
