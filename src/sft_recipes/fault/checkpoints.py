"""Checkpoints that are either complete or ignored, and rotation that never loses the last good one.

transformers 5.23 writes `checkpoint-N/` in place, piece by piece (model shards, optimizer
shards, one RNG file per rank, `trainer_state.json`), with no staging name, and deletes old
checkpoints (`save_total_limit`) from inside the save, before the other ranks have finished
theirs. A kill during a save therefore leaves a `checkpoint-N/` that `get_last_checkpoint`
picks and the resume then fails on, or, worse, silently restarts from step 0.

Here a checkpoint counts only once it holds COMPLETION_MARKER, which rank 0 writes atomically
after every rank has finished writing its part. The marker also records which recipe wrote the
checkpoint, so an output_dir of another recipe is never resumed from. Rotation moves from the
Trainer to this callback and runs after the marker, over complete checkpoints only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from sft_recipes.batching import global_batch_sequences
from sft_recipes.fault.agreement import barrier
from sft_recipes.hsdp import launched_mesh

logger = logging.getLogger(__name__)

COMPLETION_MARKER = "checkpoint_complete.json"
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


def recipe_fingerprint(identity: dict[str, Any]) -> str:
    """A short stable hash of the recipe values that decide what a run trains."""
    canonical = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    marker: dict[str, Any] | None  # None: the save was interrupted, or another tool wrote it

    @property
    def complete(self) -> bool:
        return self.marker is not None

    @property
    def fingerprint(self) -> str | None:
        return self.marker["recipe_fingerprint"] if self.marker else None

    @property
    def completed_at(self) -> float:
        return self.marker["completed_at"] if self.marker else 0.0


def read_checkpoint(path: Path) -> Checkpoint | None:
    """The checkpoint at `path`, or None if the name is not `checkpoint-<step>` or it is no directory."""
    match = _CHECKPOINT_NAME.match(path.name)
    if not match or not path.is_dir():
        return None
    try:
        marker = json.loads((path / COMPLETION_MARKER).read_text())
    except (OSError, ValueError):
        marker = None
    return Checkpoint(path, int(match.group(1)), marker)


def list_checkpoints(output_dir: str | os.PathLike) -> list[Checkpoint]:
    """Every `checkpoint-<step>` directory in output_dir, complete or not, by step."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = (read_checkpoint(path) for path in output_dir.iterdir())
    return sorted((checkpoint for checkpoint in found if checkpoint), key=lambda checkpoint: checkpoint.step)


def newest_complete_checkpoint(output_dir: str | os.PathLike) -> Checkpoint | None:
    """The complete checkpoint written last (by completion time, so an older branch never wins on step)."""
    complete = [checkpoint for checkpoint in list_checkpoints(output_dir) if checkpoint.complete]
    return max(complete, key=lambda checkpoint: checkpoint.completed_at, default=None)


def training_layout(training_args) -> dict[str, int | str]:
    """The layout a checkpoint was written on: what a resume on another world size is checked against (the
    data-parallel mesh only said: DCP reshards between HSDP, flat FSDP and one process)."""
    return {"world_size": training_args.world_size, "dataloader_num_workers": training_args.dataloader_num_workers,
            "global_batch_sequences": global_batch_sequences(training_args),
            "data_parallel_mesh": launched_mesh(training_args.world_size).describe()}


def write_marker(checkpoint_dir: Path, step: int, fingerprint: str, identity: dict[str, Any],
                 layout: dict[str, int] | None = None) -> None:
    """Write COMPLETION_MARKER atomically: a reader sees the whole file or none."""
    marker = {"step": step, "recipe_fingerprint": fingerprint, "completed_at": time.time(), "recipe": identity,
              **(layout or {})}
    staging = checkpoint_dir / f".{COMPLETION_MARKER}.tmp"
    with open(staging, "w") as handle:
        json.dump(marker, handle, indent=2, default=str)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, checkpoint_dir / COMPLETION_MARKER)
    directory = os.open(checkpoint_dir, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def rotate_checkpoints(output_dir: str | os.PathLike, keep: int | None, fingerprint: str) -> list[Path]:
    """Delete this recipe's complete checkpoints beyond the newest `keep`; return what was deleted.

    Incomplete checkpoints and other recipes' checkpoints are never touched here.
    """
    if not keep or keep <= 0:
        return []
    ours = [c for c in list_checkpoints(output_dir) if c.complete and c.fingerprint == fingerprint]
    ours.sort(key=lambda checkpoint: checkpoint.completed_at)
    deleted = [checkpoint.path for checkpoint in ours[: max(len(ours) - keep, 0)]]
    for path in deleted:
        shutil.rmtree(path)
    return deleted


class CheckpointCompletionCallback(TrainerCallback):
    """Mark each checkpoint complete once every rank has written it, then keep the newest `save_total_limit`."""

    def __init__(self, recipe_identity: dict[str, Any]) -> None:
        self.identity = recipe_identity
        self.fingerprint = recipe_fingerprint(recipe_identity)
        self.keep: int | None = None

    def on_init_end(self, args, state, control, **kwargs):
        # The Trainer would rotate inside the save, before this checkpoint is complete: we rotate after.
        self.keep, args.save_total_limit = args.save_total_limit, None

    def on_step_end(self, args, state, control, **kwargs):
        self._unmark_before_overwrite(args, state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._unmark_before_overwrite(args, state, control)

    def _unmark_before_overwrite(self, args, state, control) -> None:
        """A save into an existing complete checkpoint (resumed from an older one) first makes it incomplete.

        Runs last among the callbacks that decide to save, and before the Trainer writes: the first
        write is a collective that rank 0 only joins after this.
        """
        if control.should_save and state.is_world_process_zero:
            marker = Path(args.output_dir) / f"checkpoint-{state.global_step}" / COMPLETION_MARKER
            marker.unlink(missing_ok=True)

    def on_save(self, args, state, control, **kwargs):
        barrier(args.ddp_timeout)  # every rank has written its shards and RNG state
        if state.is_world_process_zero:
            checkpoint_dir = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            layout = training_layout(args)
            write_marker(checkpoint_dir, state.global_step, self.fingerprint, self.identity, layout)
            # One line per checkpoint (accelerate's four "[RANK 0] Saving model/optimizer ..." lines are quieted)
            logger.info("%s complete: every rank wrote its part (%s)", checkpoint_dir, layout["data_parallel_mesh"])
            for path in rotate_checkpoints(args.output_dir, self.keep, self.fingerprint):
                logger.info("save_total_limit=%s: deleted %s", self.keep, path)
        barrier(args.ddp_timeout)  # no rank moves on (or exits for requeue) before the marker is on disk
