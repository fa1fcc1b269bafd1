"""Sequence parallelism in a run: the groups, created once (what cannot work is refused by `lint.py`).

The mechanics (the all-to-all around token-mixing ops, chunking a block, the global token mean)
live in `sft_recipes.architectures.sequence_parallel` and `sft_recipes.data.sequence_shards`;
here the run decides whether it uses them and which group each rank belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from sft_recipes.architectures.sequence_parallel import SequenceParallelLayout, new_sequence_parallel_group
from sft_recipes.config import Recipe


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place among the sequence-parallel groups, and its group's process group."""

    layout: SequenceParallelLayout
    group: dist.ProcessGroup


def start_sequence_parallel(recipe: Recipe) -> SequenceParallel | None:
    """Every rank's sequence-parallel group (None for `sequence_parallel_size: 1`).

    Collective: call it on every rank, after the default process group exists.
    """
    if recipe.training.sequence_parallel_size == 1:
        return None
    assert dist.is_initialized(), "sequence parallelism needs the launcher's process group"
    layout, group = new_sequence_parallel_group(recipe.training.sequence_parallel_size)
    return SequenceParallel(layout, group)
