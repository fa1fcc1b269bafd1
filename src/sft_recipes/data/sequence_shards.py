"""One rank's share of a packed block under sequence parallelism (see ``sft_recipes.architectures.sequence_parallel``).

The ``sp_size`` ranks of a group receive the same collated block (``BlockDiagonalCollator``) and
each keeps a contiguous ``1/sp_size`` of its tokens. Labels are shifted on the whole block first:
the target of a chunk's last token is the first token of the next rank's chunk.
"""

from __future__ import annotations

from typing import Any

import torch

from sft_recipes.data.collator import IGNORE_INDEX

# Per-token inputs each rank cuts to its chunk; the token-mixing layers get the block's own
# boundaries (seq_idx, cu_seq_lens_q/k, max_length_q/k) because they run over the whole block.
CHUNKED_KEYS = ("input_ids", "position_ids")
BLOCK_KEYS = ("seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Per-token targets of a ``[B, L]`` block: token ``t`` predicts ``labels[:, t + 1]``; the last predicts nothing."""
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    return shifted


def shard_block(batch: dict[str, Any], sp_rank: int, sp_size: int) -> dict[str, Any]:
    """The model inputs of chunk ``sp_rank`` of ``sp_size`` of a collated ``[B, L]`` packed batch.

    Returns ``input_ids`` and ``position_ids`` cut to ``[B, L / sp_size]``, the block's ``seq_idx``,
    ``cu_seq_lens_q/k`` and ``max_length_q/k`` unchanged, and ``shift_labels`` (the chunk's targets,
    already shifted: compute the loss without shifting again). ``labels`` are not passed on.
    """
    block_length = batch["input_ids"].shape[1]
    if block_length % sp_size:
        raise ValueError(
            f"A packed block of {block_length} tokens does not split into sequence_parallel_size={sp_size} equal "
            f"chunks; make max_length a multiple of {sp_size}."
        )
    chunk = slice(sp_rank * block_length // sp_size, (sp_rank + 1) * block_length // sp_size)
    shard = {key: batch[key][:, chunk] for key in CHUNKED_KEYS}
    shard.update({key: batch[key] for key in BLOCK_KEYS if key in batch})
    shard["shift_labels"] = shift_labels(batch["labels"])[:, chunk]
    return shard
