"""The step's loss as the mean over every supervised token of the global batch, summed from per-rank parts.

Under sequence parallelism a rank holds a chunk of a block, so its tokens' mean means nothing on
its own: each rank sums its token losses, the supervised-token count is summed over all ranks,
and each rank back-propagates its sum divided by that global count. Summing the ranks' gradients
then gives exactly the gradient of the global mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sft_recipes.data.collator import IGNORE_INDEX


def summed_token_loss(logits: torch.Tensor, shift_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of cross-entropy over supervised tokens, number of them) for ``[B, T, V]`` logits and already
    shifted ``[B, T]`` targets (``sft_recipes.data.sequence_shards.shard_block``)."""
    loss_sum = F.cross_entropy(
        logits.flatten(0, 1).float(), shift_labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss_sum, (shift_labels != IGNORE_INDEX).sum()


def global_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """A detached copy of ``tensor`` summed over the ranks of ``group``; one process without a process
    group is the whole world (single-process evaluation)."""
    total = tensor.detach().clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, group=group)
    return total


def global_token_mean(
    loss_sum: torch.Tensor, token_count: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's share to back-propagate, the step's loss to log) over all ranks of ``group``.

    The share is ``loss_sum / global count``: the ranks' gradients must be *summed* (an all-reduce
    that averages over W ranks, as FSDP's does, needs the share multiplied by W).
    """
    global_count = global_sum(token_count, group)
    share = loss_sum / global_count.clamp(min=1)
    return share, global_sum(share, group)
