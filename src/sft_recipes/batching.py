"""Global batch as a first-class setting: one recipe, the same experiment on 1, 2 or 4 nodes.

A recipe may give `global_batch_size` (sequences per optimizer step) or `global_batch_tokens`
(tokens per step; sequences are `max_length` tokens, as packed blocks are). Gradient
accumulation is then derived from the world size, and the derivation is printed with every factor.
The ranks of a sequence-parallel group share their sequences: a step holds `per_device x
(world size / sequence_parallel_size) x accumulation` sequences.
"""

from __future__ import annotations


def derive_gradient_accumulation(training_args, world_size: int) -> tuple[int, str]:
    """Gradient accumulation steps for the recipe's global batch on `world_size` processes, and how.

    ValueError, listing every factor, when the world size cannot produce the global batch exactly.
    """
    micro = training_args.per_device_train_batch_size
    sp_size = training_args.sequence_parallel_size
    if sp_size < 1 or world_size % sp_size:
        raise ValueError(f"sequence_parallel_size={sp_size} must be a positive divisor of the world size {world_size}.")
    groups = world_size // sp_size
    per_step = micro * groups
    ranks = (f"{world_size} processes" if sp_size == 1 else
             f"{groups} sequence-parallel groups ({world_size} processes / sequence_parallel_size {sp_size})")
    global_sequences = training_args.global_batch_size
    unit = "sequences"
    if training_args.global_batch_tokens is not None:
        if global_sequences is not None:
            raise ValueError("Give global_batch_size or global_batch_tokens, not both.")
        max_length = training_args.max_length
        if not max_length or training_args.global_batch_tokens % max_length:
            raise ValueError(
                f"global_batch_tokens={training_args.global_batch_tokens} is not a whole number of "
                f"max_length={max_length}-token sequences: make it a multiple of max_length."
            )
        global_sequences = training_args.global_batch_tokens // max_length
        unit = f"sequences ({training_args.global_batch_tokens} tokens / {max_length} per sequence)"
    if global_sequences is None:
        accumulation = training_args.gradient_accumulation_steps
        return accumulation, (f"global batch {per_step * accumulation} sequences = {micro} per device x "
                              f"{ranks} x {accumulation} accumulation steps")
    if global_sequences % per_step:
        raise ValueError(
            f"The global batch of {global_sequences} {unit} cannot be made on {world_size} processes: "
            f"{micro} per device x {ranks} = {per_step} sequences per micro-step, which does not "
            f"divide {global_sequences}. Change per_device_train_batch_size, the number of processes, or the global batch."
        )
    accumulation = global_sequences // per_step
    return accumulation, (f"global batch {global_sequences} {unit} = {micro} per device x {ranks} "
                          f"x {accumulation} accumulation steps (derived)")


def global_batch_sequences(training_args) -> int:
    """Sequences per optimizer step as the run makes them: per device x data-parallel groups (processes /
    sequence_parallel_size) x accumulation steps."""
    groups = training_args.world_size // training_args.sequence_parallel_size
    return training_args.per_device_train_batch_size * groups * training_args.gradient_accumulation_steps
