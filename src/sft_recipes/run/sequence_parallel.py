"""Sequence parallelism in a run: refuse a setting that cannot work, then create the groups, once.

The mechanics (the all-to-all around token-mixing ops, chunking a block, the global token mean)
live in `sft_recipes.architectures.sequence_parallel` and `sft_recipes.data.sequence_shards`;
here the run decides whether it uses them and which group each rank belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from sft_recipes.architectures.sequence_parallel import (
    SUPPORTED_IMPLEMENTATIONS,
    SequenceParallelLayout,
    check_sequence_parallel_size,
    new_sequence_parallel_group,
)
from sft_recipes.config import Recipe
from sft_recipes.errors import RecipeError


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place among the sequence-parallel groups, and its group's process group."""

    layout: SequenceParallelLayout
    group: dist.ProcessGroup


def sequence_parallel_problems(recipe: Recipe, world_size: int, model_config) -> list[str]:
    """Why `sequence_parallel_size` cannot run this recipe on `world_size` processes (empty: it can)."""
    size = recipe.training.sequence_parallel_size
    if size == 1:
        return []
    if size < 1:
        return [f"sequence_parallel_size must be at least 1 (1 turns it off), got {size}"]
    problems = []
    if not recipe.data.pack_blocks:
        problems.append(f"sequence_parallel_size={size} splits packed blocks: set pack_blocks: true (with a chat "
                        "dataset_format), or sequence_parallel_size: 1")
    if world_size % size:
        divisors = [n for n in range(1, world_size + 1) if world_size % n == 0]
        problems.append(f"sequence_parallel_size={size} must divide the world size {world_size}: choose one of "
                        f"{divisors}, or launch a multiple of {size} processes")
    max_length = recipe.training.max_length
    if not max_length or max_length % size:
        problems.append(f"sequence_parallel_size={size} gives each rank an equal chunk of the max_length-token block: "
                        f"max_length={max_length} is not a multiple of {size}; make it one")
    implementation = recipe.model.attn_implementation
    if implementation not in SUPPORTED_IMPLEMENTATIONS:
        problems.append(f"sequence parallelism runs attention with the block's boundaries in "
                        f"{', '.join(SUPPORTED_IMPLEMENTATIONS)}, not attn_implementation {implementation!r}")
    if not recipe.training.average_tokens_across_devices:
        problems.append("sequence parallelism divides each rank's chunk loss by the step's supervised tokens over "
                        "all ranks: leave average_tokens_across_devices at true")
    try:
        check_sequence_parallel_size(model_config.get_text_config(), size)
    except ValueError as err:
        problems.append(str(err).rstrip("."))
    return problems


def refuse_unworkable_sequence_parallel(recipe: Recipe, world_size: int, model_config) -> None:
    """A RecipeError naming every reason `sequence_parallel_size` cannot run, with its fix."""
    if problems := sequence_parallel_problems(recipe, world_size, model_config):
        raise RecipeError("; ".join(problems) + ".")


def start_sequence_parallel(recipe: Recipe) -> SequenceParallel | None:
    """Every rank's sequence-parallel group (None for `sequence_parallel_size: 1`).

    Collective: call it on every rank, after the default process group exists.
    """
    if recipe.training.sequence_parallel_size == 1:
        return None
    assert dist.is_initialized(), "sequence parallelism needs the launcher's process group"
    layout, group = new_sequence_parallel_group(recipe.training.sequence_parallel_size)
    return SequenceParallel(layout, group)
