"""Resuming on another number of processes: what carries over exactly, and what is refused.

Map-style data (TRL's dataset): accelerate seeds one permutation of the rows, the same on every
rank and for every world size (`SeedableRandomSampler`: the recipe's seed + the epoch), and its
`BatchSamplerShard` hands micro-batch j of that permutation to rank j % world_size. With the
global batch G fixed, optimizer step s therefore trains on rows [s*G, (s+1)*G) of the permutation
on any world size, and the resume skip (`global_step x gradient_accumulation_steps` micro-batches
per rank) lands on row s*G too. The loss is normalised over the tokens of the whole global batch
(`average_tokens_across_devices`), and DCP reshards the model and optimizer state on load. Two
things are not world-size independent by themselves, and are handled here:
  - the epoch's last, partial global batch: accelerate pads it per rank by wrapping around to the
    first rows, so its contents depend on the world size. `whole_global_batches` ends every epoch
    on a whole global batch instead (at most G - 1 rows a pass are left out, others each epoch);
  - a recipe that fixes `gradient_accumulation_steps` instead of the global batch: another world
    size is another global batch, hence another training. `refuse_another_training_layout` refuses
    it and names the fix (`global_batch_size`).
Random streams (dropout) are per rank (`rng_state_<rank>.pth`) and do not map onto another world size.

Packed block streams: each (rank, dataloader worker) reader streams its own shard, and a resume
skips, per reader, what that reader had read. Another number of readers cuts other shards, so a
resume is refused unless ranks x max(1, dataloader_num_workers) is unchanged; layouts with the
same reader count (1 x 4, 2 x 2, 4 x 1) resume exactly because readers are numbered so that every
step takes the same blocks of the same readers on each of them (`data.blocks.reader_index`;
numbered `rank x workers + worker`, 2 x 2 and 1 x 4 read the readers in another order whenever a
step took fewer blocks than there are readers).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch.utils.data import RandomSampler

from sft_recipes.batching import global_batch_sequences
from sft_recipes.errors import RecipeError
from sft_recipes.fault.checkpoints import read_checkpoint
from sft_recipes.hsdp import launched_mesh

logger = logging.getLogger(__name__)

# In the recipe identity when packing. A group is one process, or the sequence_parallel_size processes sharing blocks.
READERS_KEY = "packed_stream_readers (sequence-parallel groups x dataloader_num_workers)"


def stream_readers(training_args) -> int:
    """Readers of a packed stream: one per (data-parallel group, dataloader worker)."""
    groups = training_args.world_size // training_args.sequence_parallel_size
    return groups * max(1, training_args.dataloader_num_workers)


def whole_global_batches(sampler, training_args):
    """The Trainer's random sampler, cut to a whole number of global batches per epoch.

    The permutation is unchanged (the same seed and length), only its tail is not drawn: every optimizer
    step then trains on G rows of it, whatever the world size, also at the end of an epoch.
    """
    if type(sampler) is not RandomSampler or sampler.replacement:
        return sampler  # group_by_length, sequential, ...: their own order, left as they are
    rows, global_batch = len(sampler.data_source), global_batch_sequences(training_args)
    if rows < global_batch:
        raise RecipeError(f"the train set has {rows} rows, fewer than one global batch of {global_batch} sequences: "
                          "use more data or a smaller global_batch_size")
    return RandomSampler(sampler.data_source, num_samples=rows // global_batch * global_batch)


def reader_layouts(readers: int) -> str:
    """Every (groups x dataloader workers) layout with `readers` readers, e.g. '1 x 4, 2 x 2, 4 x 1'."""
    layouts = [f"{ranks} x {readers // ranks}" for ranks in range(1, readers + 1) if readers % ranks == 0]
    return ", ".join(layouts)


def readers_refusal(theirs: dict[str, Any], ours: dict[str, Any], where: str) -> str | None:
    """Why a packed stream cannot resume with another number of readers, and which layouts can; None if it can."""
    then, now = theirs.get(READERS_KEY), ours.get(READERS_KEY)
    if then is None or now is None or then == now:
        return None
    return (f"{where} was written by {then} packed-stream readers (groups x dataloader workers; a group is one "
            f"process, or sequence_parallel_size processes), this run has "
            f"{now}. Each reader streams its own shard of the data and a resume skips, per reader, what it had "
            f"read: with {now} readers the shards are cut differently, so some conversations would be trained "
            f"twice and others never. Resume with groups x max(1, dataloader_num_workers) = {then}, i.e. "
            f"{reader_layouts(then)} (dataloader_num_workers 0 counts as 1), or train in another output_dir")


def refuse_another_training_layout(checkpoint: str, training_args) -> None:
    """RecipeError when resuming `checkpoint` here would change the global batch or the packed-stream readers.

    Checkpoints whose marker predates the layout record (or has none) are not checked.
    """
    found = read_checkpoint(Path(checkpoint))
    marker = found.marker if found else None
    if not marker or "global_batch_sequences" not in marker:
        return
    readers_here = {READERS_KEY: stream_readers(training_args)}
    refusal = readers_refusal(marker.get("recipe", {}), readers_here, f"checkpoint {checkpoint}")
    if refusal:  # the checkpoint is a packed stream's (map-style markers have no reader count)
        raise RecipeError(refusal)
    then, now = marker["global_batch_sequences"], global_batch_sequences(training_args)
    if then != now:
        raise RecipeError(
            f"checkpoint {checkpoint} was trained with a global batch of {then} sequences per optimizer step on "
            f"{marker['world_size']} process(es); here it would be {now} ({training_args.per_device_train_batch_size} "
            f"per device x {training_args.world_size} processes x {training_args.gradient_accumulation_steps} "
            f"accumulation steps), another training. Set global_batch_size: {then} in the recipe (and drop "
            "gradient_accumulation_steps) so accumulation follows the world size, or resume on "
            f"{marker['world_size']} process(es)")


def log_world_size_change(checkpoint: str, training_args) -> int | None:
    """Say what a resume on another world size or data-parallel mesh (HSDP <-> flat FSDP) keeps; return the
    checkpoint's world size."""
    found = read_checkpoint(Path(checkpoint))
    marker = (found.marker if found else None) or {}
    then, mesh_then = marker.get("world_size"), marker.get("data_parallel_mesh")
    mesh_now = launched_mesh(training_args.world_size).describe()
    moved = (then is not None and then != training_args.world_size) or (mesh_then not in (None, mesh_now))
    if moved and training_args.process_index == 0:
        logger.warning("resuming %s, written on %s, on %s: model and optimizer state are resharded (DCP), the data "
                       "continues at the same row; per-rank random streams (dropout) do not carry over", checkpoint,
                       mesh_then or f"{then} process(es)", mesh_now)
    return then
