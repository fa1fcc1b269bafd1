"""Surviving preemption, dead ranks, bad steps and half-written checkpoints.

Each module holds one mechanism; `fault_tolerance_callbacks` hands `scripts/sft.py` the callbacks
every run uses, in the order they must run.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from sft_recipes.fault.checkpoints import CheckpointCompletionCallback
from sft_recipes.fault.nonfinite import NonFiniteGuard
from sft_recipes.fault.preemption import PreemptionCallback


def fault_tolerance_callbacks(training_args, recipe_identity: dict[str, Any]) -> list[TrainerCallback]:
    """Preemption stop, non-finite step guard, and checkpoint completion markers (in that order)."""
    return [
        PreemptionCallback(),
        NonFiniteGuard(training_args.max_nonfinite_steps_in_a_row),
        # Last: it marks a checkpoint complete after the others have asked for the save.
        CheckpointCompletionCallback(recipe_identity),
    ]
