"""Block-diagonal packing: examples share a row, nothing crosses an example boundary.

A packed row carries, besides ``input_ids`` and ``labels``, the signals each kind of layer needs
to keep examples apart:

* ``position_ids`` restart at 0 per example: RoPE, and the sdpa/eager/flex masks that transformers
  derives from them (only when no ``attention_mask`` and no KV cache is given);
* ``cu_seq_lens_q/k`` (int32, over the flattened batch) and ``max_length_q/k``: flash-attention
  varlen and the gated-delta recurrence (``fla``'s ``cu_seqlens``);
* ``seq_idx`` (int32, per token): the short causal convolution of linear-attention layers;
* ``labels`` -100 on each example's first token, so the shifted loss never predicts an
  example's first token from the previous one.

How this relates to TRL 1.16 (read ``trl/trainer/sft_trainer.py`` and ``trl/data_utils.py``):

* Reused: TRL's padding-free format. Key names, dtypes and the label rule are TRL's
  (``DataCollatorForLanguageModeling(padding_free=True)``); for one exactly filled row both
  collators give the same output, which the tests check. Rows packed by TRL's best-fit-decreasing
  packer (``trl.pack_dataset(..., strategy="bfd")``, which marks them with ``seq_lengths``) are
  accepted as they are, so a map-style dataset can keep TRL's tighter bin packing.
* Added, because TRL lacks it:
  - fixed-length rows: every row is exactly ``max_length`` tokens (TRL flattens a batch into one
    row of varying length), so with whole blocks per step -- the reference recipe's one
    ``max_length`` block -- every step has the same token budget and memory peak; the unused
    tail of a row is padding that forms a segment of its own;
  - ``[B, max_length]`` rows with a per-row ``seq_idx`` (TRL always emits a single row);
  - packing at collation, end to end in arrival order, which works for streamed data without a
    global packing pass, either splitting examples at block edges (the reference recipe: every
    block is full) or keeping them whole (an example starts a new block when it does not fit);
  - a collator TRL's trainer accepts: it refuses a custom collator when ``padding_free`` is on,
    so use this one with ``padding_free=False`` and ``packing=False``. It reads the ``labels``
    TRL's dataset preparation builds, or ``assistant_masks`` / ``completion_mask`` directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

IGNORE_INDEX = -100
# Per-token masks the collator understands, as TRL names them; a token keeps its label only if
# every mask present marks it.
SUPERVISION_MASK_KEYS = ("assistant_masks", "completion_mask")


def pack_kwargs(seq_lens: Sequence[int], labels: torch.Tensor | None = None) -> dict[str, Any]:
    """Boundary kwargs for one packed row made of examples of lengths ``seq_lens``, in order.

    Returns ``position_ids`` [1, T] (int64), ``seq_idx`` [1, T] (int32), ``cu_seq_lens_q/k`` [n+1]
    (int32) and ``max_length_q/k``; with ``labels`` (T tokens), also ``labels`` [1, T], a copy with
    -100 on the first token of every example.
    """
    lengths = torch.as_tensor(list(seq_lens), dtype=torch.int64)
    if lengths.numel() == 0 or bool((lengths <= 0).any()):
        raise ValueError(
            f"pack_kwargs needs at least one example and only positive lengths, got {list(seq_lens)}; "
            "drop empty examples before packing."
        )
    total = int(lengths.sum())
    starts = torch.cumsum(lengths, 0) - lengths
    cu_seq_lens = torch.cat([starts, lengths.sum().reshape(1)]).to(torch.int32)
    position_ids = torch.arange(total) - torch.repeat_interleave(starts, lengths)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths)
    max_length = int(lengths.max())
    kwargs: dict[str, Any] = {
        "position_ids": position_ids.unsqueeze(0),
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max_length,
        "max_length_k": max_length,
        "seq_idx": seq_idx.unsqueeze(0),
    }
    if labels is not None:
        labels = labels.reshape(-1).clone()
        if labels.numel() != total:
            raise ValueError(f"labels have {labels.numel()} tokens but seq_lens add up to {total}; they must match.")
        labels[starts] = IGNORE_INDEX
        kwargs["labels"] = labels.unsqueeze(0)
    return kwargs


@dataclass
class BlockDiagonalCollator:
    """Packs pre-tokenized examples end to end into ``[B, max_length]`` block-diagonal rows.

    Each example has ``input_ids``, optionally ``labels`` (default: the input ids; -100 = no
    loss, as TRL's dataset preparation builds them), optionally ``assistant_masks`` /
    ``completion_mask`` (0 = label -100) and optionally ``seq_lengths`` when it is a row already
    packed by ``trl.pack_dataset`` (its segments are kept). B is as many blocks as the
    batch needs; the last block (``split_examples=True``) or every block's unused tail
    (``split_examples=False``) is ``pad_token_id`` with label -100, as a segment of its own.

    ``split_examples=True`` (the reference recipe): examples run on across block edges, so every
    block but the last is full; the part after an edge restarts at position 0 and loses its
    earlier context. ``split_examples=False``: an example that does not fit in the current block
    starts the next one; a single example longer than ``max_length`` keeps its first
    ``max_length`` tokens (as TRL's ``bfd`` does).

    ``block_per_row=True``: every item is a block packed upstream (``pack_blocks``) and gets a row of
    its own, its unused tail padded; the collator packs nothing further.

    ``cu_seq_lens_q/k`` count over the B rows back to back and include every row edge: fla's gated-delta
    kernel takes ``cu_seqlens`` only with one row, and `architectures.qwen3_5` hands it the B rows as
    that one row (docs/kernels.md).
    """

    max_length: int
    pad_token_id: int
    split_examples: bool = True
    block_per_row: bool = False

    def __post_init__(self) -> None:
        if self.max_length <= 0:
            raise ValueError(f"max_length must be positive, got {self.max_length}.")

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        items = [_Item.from_example(example) for example in examples if len(example["input_ids"])]
        if not items:
            raise ValueError("BlockDiagonalCollator got no tokens: every example in the batch is empty.")
        if self.block_per_row and max(len(item.input_ids) for item in items) > self.max_length:
            raise ValueError(f"block_per_row: a block is longer than max_length={self.max_length}; pack_blocks "
                             "with the same max_length makes blocks that fit.")
        if not self.split_examples:
            items = [item.truncated(self.max_length) for item in items]

        item_starts = self._place(np.array([len(item.input_ids) for item in items]))
        num_blocks = -(-int(item_starts[-1] + len(items[-1].input_ids)) // self.max_length)
        num_slots = num_blocks * self.max_length

        tokens = np.full(num_slots, self.pad_token_id, dtype=np.int64)
        labels = np.full(num_slots, IGNORE_INDEX, dtype=np.int64)
        slots = np.concatenate([start + np.arange(len(item.input_ids)) for start, item in zip(item_starts, items)])
        tokens[slots] = np.concatenate([item.input_ids for item in items])
        labels[slots] = np.concatenate([item.labels for item in items])

        # Segments end where an example (or a pre-packed segment) ends and at every block edge;
        # the gaps this leaves before block edges are the padding segments.
        example_ends = np.concatenate(
            [start + np.cumsum(item.seq_lengths) for start, item in zip(item_starts, items)]
        )
        block_edges = np.arange(1, num_blocks + 1) * self.max_length
        segment_ends = np.union1d(example_ends, block_edges)
        seq_lens = np.diff(segment_ends, prepend=0)

        kwargs = pack_kwargs(seq_lens.tolist(), labels=torch.from_numpy(labels))
        rows = (num_blocks, self.max_length)
        return {
            "input_ids": torch.from_numpy(tokens).reshape(rows),
            "labels": kwargs.pop("labels").reshape(rows),
            "position_ids": kwargs.pop("position_ids").reshape(rows),
            "seq_idx": kwargs.pop("seq_idx").reshape(rows),
            **kwargs,
        }

    def _place(self, lengths: np.ndarray) -> np.ndarray:
        """Start slot of each item in the flattened ``[B * max_length]`` batch."""
        if self.block_per_row:
            return np.arange(len(lengths)) * self.max_length
        if self.split_examples:
            return np.cumsum(lengths) - lengths
        starts = np.empty_like(lengths)
        block_start, fill = 0, 0
        for i, length in enumerate(lengths.tolist()):
            if fill + length > self.max_length:
                block_start, fill = block_start + self.max_length, 0
            starts[i] = block_start + fill
            fill += length
        return starts


@dataclass
class _Item:
    """One example, or one row pre-packed by TRL, as flat arrays."""

    input_ids: np.ndarray
    labels: np.ndarray
    seq_lengths: np.ndarray

    @classmethod
    def from_example(cls, example: dict[str, Any]) -> _Item:
        input_ids = np.asarray(example["input_ids"], dtype=np.int64)
        labels = np.array(example.get("labels", input_ids), dtype=np.int64)
        for key in ("labels", *SUPERVISION_MASK_KEYS):
            if example.get(key) is not None and len(example[key]) != len(input_ids):
                raise ValueError(
                    f"{key} has {len(example[key])} entries but input_ids has {len(input_ids)} tokens; "
                    "build it from the same tokenization."
                )
        for key in SUPERVISION_MASK_KEYS:
            if example.get(key) is not None:
                labels[~np.asarray(example[key], dtype=bool)] = IGNORE_INDEX
        seq_lengths = np.asarray(example.get("seq_lengths", [len(input_ids)]), dtype=np.int64)
        if seq_lengths.sum() != len(input_ids) or (seq_lengths <= 0).any():
            raise ValueError(
                f"seq_lengths {seq_lengths.tolist()} must be positive and add up to the {len(input_ids)} tokens "
                "of input_ids; pass rows exactly as trl.pack_dataset returns them."
            )
        return cls(input_ids, labels, seq_lengths)

    def truncated(self, max_length: int) -> _Item:
        if len(self.input_ids) <= max_length:
            return self
        if len(self.seq_lengths) > 1:
            raise ValueError(
                f"A pre-packed row has {len(self.input_ids)} tokens, more than max_length={max_length}; "
                f"pack it with trl.pack_dataset(..., seq_length={max_length})."
            )
        return _Item(self.input_ids[:max_length], self.labels[:max_length], np.array([max_length]))
