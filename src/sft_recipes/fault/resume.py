"""Which checkpoints in a run's output_dir it may resume from, and which recipe changes a resume allows."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from sft_recipes.fault.checkpoints import (
    COMPLETION_MARKER,
    list_checkpoints,
    newest_complete_checkpoint,
    read_checkpoint,
    recipe_fingerprint,
)
from sft_recipes.errors import RecipeError
from sft_recipes.fault.world_size import READERS_KEY, readers_refusal, refuse_another_training_layout, stream_readers

logger = logging.getLogger(__name__)
TRAINER_STATE_NAME = "trainer_state.json"  # transformers' own name: every checkpoint save writes it

# What a finished run leaves in output_dir and a new run would overwrite: the export (a model or an adapter) and
# the card and summary written after it.
FINISHED_RUN_FILES = frozenset({
    "config.json", "model.safetensors", "model.safetensors.index.json", "adapter_config.json",
    "adapter_model.safetensors", "README.md", "run_summary.json",
})

# Recipe keys a resumed run may change without becoming "another recipe": where and how often it
# saves and logs, how long it runs, how it exports, how patient its guards are.
RESUME_SAFE_KEYS = frozenset({
    "output_dir", "resume_from_checkpoint", "overwrite_output_dir", "max_steps", "num_train_epochs",
    "save_strategy", "save_steps", "save_total_limit", "logging_strategy", "logging_steps", "logging_first_step",
    "report_to", "run_name", "mlflow_experiment_name", "export_dtype", "verify_export", "ddp_timeout",
    "max_nonfinite_steps_in_a_row", "max_dropped_share", "dataloader_num_workers", "disable_tqdm",
    "sample_prompts", "sample_max_new_tokens", "push_to_hub", "hub_model_id", "hub_private_repo",
})


def recipe_identity(recipe) -> dict[str, Any]:
    """The recipe values that decide what is trained: every key the recipe sets but RESUME_SAFE_KEYS, and
    for packed streams the number of readers (its data order).

    Values are read back from the parsed arguments, so `3e-3` and `0.003` are the same recipe.
    """
    owners = (recipe.data, recipe.model, recipe.training)
    identity = {key: getattr(next(owner for owner in owners if hasattr(owner, key)), key)
                for key in sorted(recipe.values) if key not in RESUME_SAFE_KEYS}
    if recipe.data.pack_blocks:
        # Each (sequence-parallel group, dataloader worker) streams its own shard: resumed with another count of
        # readers, the skipped batches would be other data, so the run would re-read some and never see the rest.
        # Only the count matters (2 groups x 2 workers resumes 4 groups x 1 worker): see fault.world_size.
        identity[READERS_KEY] = stream_readers(recipe.training)
    return identity


def _explicit_resume_path(training_args) -> Path | None:
    wanted = training_args.resume_from_checkpoint
    return Path(wanted).resolve() if wanted not in (None, "auto") else None


def _changed_keys(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    ours = json.loads(json.dumps(ours, default=str))  # compared as the markers store them
    return [key for key in sorted(set(theirs) | set(ours)) if theirs.get(key, "<unset>") != ours.get(key, "<unset>")]


def _recipe_diff(theirs: dict[str, Any], ours: dict[str, Any]) -> str:
    ours = json.loads(json.dumps(ours, default=str))  # shown as the markers store them ('steps', not an enum's repr)
    changed = [f"{key}: {theirs.get(key, '<unset>')!r} there, {ours.get(key, '<unset>')!r} here"
               for key in _changed_keys(theirs, ours)]
    return "; ".join(changed[:8]) + (f"; and {len(changed) - 8} more" if len(changed) > 8 else "")


def protect_output_dir(recipe, training_args) -> list[Path]:
    """Refuse to mix this recipe's checkpoints with another recipe's; set aside what cannot be resumed.

    - complete checkpoints of another recipe: ValueError, unless `overwrite_output_dir`;
    - `overwrite_output_dir`: every checkpoint is set aside and the run starts over;
    - incomplete checkpoints (an interrupted save, or another tool's): set aside, so they are neither
      resumed from nor overwritten piecemeal by a later save of the same step.
    - no complete checkpoint of this recipe, but a finished run's export or card there (FINISHED_RUN_FILES, e.g.
      another run trained without checkpoints, or a user's own README.md): ValueError, since training would
      overwrite them, unless `overwrite_output_dir`, which sets them aside too. A run stopped before its first
      checkpoint leaves none of them (it writes train.log and data_report.json before then), so
      retrying it starts fresh.
    Setting aside moves a checkpoint into `output_dir/set-aside-<time>/`; nothing is deleted.
    Every rank decides the same; rank 0 moves. Returns the new paths of what was moved.
    """
    output_dir = Path(training_args.output_dir)
    identity = recipe_identity(recipe)
    fingerprint = recipe_fingerprint(identity)
    explicit = _explicit_resume_path(training_args)
    checkpoints = [c for c in list_checkpoints(output_dir) if c.path.resolve() != explicit]
    foreign = [c for c in checkpoints if c.complete and c.fingerprint != fingerprint]
    if foreign and not training_args.overwrite_output_dir:
        newest = max(foreign, key=lambda c: c.completed_at)
        theirs = newest.marker.get("recipe", {})
        if _changed_keys(theirs, identity) == [READERS_KEY]:  # the same recipe on another packed-stream layout
            raise RecipeError(f"{readers_refusal(theirs, identity, f'{output_dir}/{newest.path.name}')}, or pass "
                              "--overwrite_output_dir true to start over here")
        raise RecipeError(
            f"output_dir {output_dir} holds checkpoints of another recipe ({', '.join(c.path.name for c in foreign)}): "
            f"{_recipe_diff(newest.marker.get('recipe', {}), identity)}. Resuming would mix two trainings. Use "
            "another output_dir, or pass --overwrite_output_dir true to start over here (the old checkpoints are "
            "moved to a set-aside-<time>/ folder, not deleted)."
        )
    finished = sorted(path for path in output_dir.glob("*") if path.name in FINISHED_RUN_FILES)
    resumable = explicit is not None or any(c.complete for c in checkpoints)
    if finished and not resumable and not training_args.overwrite_output_dir:
        raise RecipeError(
            f"output_dir {output_dir} holds {', '.join(path.name for path in finished)} and no checkpoint to resume "
            f"from: this run would overwrite {'them' if len(finished) > 1 else 'it'}. Use another output_dir, or pass "
            "--overwrite_output_dir true to start over here (what a run would overwrite is moved to a "
            "set-aside-<time>/ folder, not deleted).")
    if training_args.overwrite_output_dir:
        to_move = [c.path for c in checkpoints] + finished
    else:
        to_move = [c.path for c in checkpoints if not c.complete]
    if not to_move:
        return []
    aside = output_dir / f"set-aside-{time.strftime('%Y%m%d-%H%M%S')}"
    if training_args.process_index == 0:
        aside.mkdir(parents=True, exist_ok=True)
        for path in to_move:
            path.rename(aside / path.name)
        logger.warning("moved %s into %s (%s)", ", ".join(path.name for path in to_move), aside,
                       "overwrite_output_dir" if training_args.overwrite_output_dir
                       else f"no {COMPLETION_MARKER}: an interrupted save, or written by another tool")
    return [aside / path.name for path in to_move]


def resolve_resume_checkpoint(training_args) -> str | None:
    """`resume_from_checkpoint`: None (fresh), "auto" (newest complete one in output_dir, else fresh) or a path.

    Another world size resumes when the global batch (and, for packed streams, the reader count) is the
    same; otherwise RecipeError names what would change and the fix (see `fault.world_size`).
    """
    chosen = _resume_checkpoint(training_args)
    if chosen is not None:
        refuse_another_training_layout(chosen, training_args)
    return chosen


def nothing_left_to_train(checkpoint: str | None, training_args) -> str | None:
    """Why a run resuming from `checkpoint` would train no step, or None when steps remain.

    transformers resumes a checkpoint already at `max_steps` and still takes one more optimizer step
    (checkpoint-4 with max_steps 4 trained step 5, saved checkpoint-5 and a summary of that step alone), so a
    finished run is recognised here, before anything loads, and the run ends with exit 0 having written nothing.
    An epoch-based run is finished when its checkpoint reached the steps of the same number of epochs.
    """
    if checkpoint is None:
        return None
    try:
        state = json.loads((Path(checkpoint) / TRAINER_STATE_NAME).read_text())
    except (OSError, ValueError):
        return None  # the Trainer reports a checkpoint it cannot read
    done = int(state.get("global_step", 0))
    ended = ((state.get("stateful_callbacks") or {}).get("StopWhenAnyRankExhausted") or {}).get("attributes", {})
    if ended.get("data_ended_at_step") is not None and training_args.max_steps > 0:
        return (f"{checkpoint} ended where its packed stream ended, at step {done}: the stream was read once, so "
                f"there is nothing left to read for max_steps {training_args.max_steps}; nothing written. To train "
                "several passes over a stream pass --max_steps -1 --num_train_epochs N with --overwrite_output_dir "
                "true (the stream is counted before training, every pass in a new order).")
    if training_args.max_steps > 0:
        if done < training_args.max_steps:
            return None
        target = f"max_steps {training_args.max_steps}"
    elif (done < int(state.get("max_steps", 0) or 0)
          or state.get("num_train_epochs") != math.ceil(training_args.num_train_epochs)):  # the Trainer stores it so
        return None
    else:
        target = f"num_train_epochs {training_args.num_train_epochs:g} ({done} steps)"
    return (f"{checkpoint} has already trained {done} step(s), reaching {target}: nothing to train, nothing written. "
            f"To train further pass a larger --max_steps (e.g. --max_steps {2 * done}); to start over in this output_dir "
            "pass --overwrite_output_dir true.")


def refuse_a_resume_path_without_a_checkpoint(wanted: str | None, output_dir: str) -> None:
    """A resume_from_checkpoint path that is no checkpoint folder (none there, or no trainer_state.json in it: an
    output_dir, an empty folder) is one refusal, naming the checkpoints it holds; None and auto pass. Cheap: the
    launch pre-check runs it too, before any process starts."""
    if wanted in (None, "auto"):
        return
    folder = Path(wanted)
    use = (f"Use 'auto' to take the newest checkpoint in output_dir, or a path like "
           f"{output_dir}/checkpoint-100.")
    if not folder.is_dir():
        raise RecipeError(f"resume_from_checkpoint={wanted!r} is not a checkpoint directory. {use}")
    if not (folder / TRAINER_STATE_NAME).is_file():  # what every save writes; transformers fails later without it
        inside = [checkpoint.path.name for checkpoint in list_checkpoints(folder)]
        held = f"; it holds {', '.join(inside)}: pass one of them" if inside else ""
        raise RecipeError(f"resume_from_checkpoint={wanted!r} holds no checkpoint (no {TRAINER_STATE_NAME}){held}. "
                          f"{use}")


def _resume_checkpoint(training_args) -> str | None:
    wanted = training_args.resume_from_checkpoint
    if wanted is None:
        return None
    is_main = training_args.process_index == 0
    if wanted == "auto" and training_args.overwrite_output_dir:
        # Starts over, decided from the arguments alone: the other ranks may still list the checkpoints that
        # rank 0 is setting aside, and one that resumed from them would leave rank 0 alone in a collective.
        if is_main:
            logger.info("resume_from_checkpoint=auto: overwrite_output_dir, starting fresh")
        return None
    if wanted == "auto":
        output_dir = Path(training_args.output_dir)
        newest = newest_complete_checkpoint(output_dir)
        incomplete = [c.path.name for c in list_checkpoints(output_dir) if not c.complete]
        if is_main and incomplete:
            logger.warning("resume_from_checkpoint=auto: skipping %s (no %s: the save did not finish)",
                           ", ".join(incomplete), COMPLETION_MARKER)
        if is_main:
            logger.info("resume_from_checkpoint=auto: %s",
                        f"resuming from {newest.path}" if newest else "no complete checkpoint, starting fresh")
        return str(newest.path) if newest else None
    refuse_a_resume_path_without_a_checkpoint(wanted, training_args.output_dir)
    checkpoint = read_checkpoint(Path(wanted))
    if is_main and (checkpoint is None or not checkpoint.complete):
        logger.warning("resume_from_checkpoint=%s has no %s: resuming anyway, as asked", wanted, COMPLETION_MARKER)
    return wanted
