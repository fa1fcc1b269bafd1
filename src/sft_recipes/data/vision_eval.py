"""Held-out eval of an image run: whole examples packed into blocks, their pixels made when a block is read.

The eval conversations (image rows as `mixture.with_images_checked` leaves them, text-only rows with no
images) are packed once at start the way the training stream packs them -- best-fit over whole examples,
each keeping its own mRoPE positions; an example longer than a block is left out (cutting it would part
image tokens from their pixels) and counted, as is one the masker or its images drop, by reason. What
stays in memory is the plan: which rows make which block. Not the pixels: a block of 13 images of 588
tokens holds ~47M patch values (~190 MB in fp32), so each read of a block processes its rows' images
again, the same deterministic way (and the plan is made `PLAN_ROWS` rows at a time: 500 such rows at
once would be ~7 GB per rank). Blocks go through the training collator (`VisionBlockCollator`) and the
token-weighted eval loop (`evaluation.py`) unchanged.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from sft_recipes.data.blocks import IGNORE_INDEX, fill_blocks, join_examples
from sft_recipes.data.vision import IMAGES_FIELD, VisionExample, VisionProcessing

LONGER_THAN_BLOCK = "longer_than_max_length"  # an image conversation is never cut: its image tokens need their pixels


PLAN_ROWS = 16  # rows whose pixels are held at once while the plan is made (~14 MB each at 588 image tokens)


class VisionEvalBlocks:
    """Eval blocks of image (and text) conversations: what `evaluation.RankEvalBatches` reads (len, select, [i])."""

    def __init__(self, rows, processing: VisionProcessing, block_length: int, template_kwargs: dict | None = None):
        self.rows, self.processing, self.template_kwargs = rows, processing, dict(template_kwargs or {})
        kept, left_out = [], Counter()  # left out, by reason: the masker's or an image's, or LONGER_THAN_BLOCK
        for index, example in self._each_example():
            if isinstance(example, str):
                left_out[example] += 1
            elif len(example.labels) > block_length:
                left_out[LONGER_THAN_BLOCK] += 1
            else:
                kept.append((index, example.labels))
        self.left_out = dict(left_out)
        self.tokens = sum(len(labels) for _, labels in kept)
        self.supervised = sum(len(labels) - 1 - labels[1:].count(IGNORE_INDEX) for _, labels in kept)
        self.plan = [block["row_index"].tolist() for block in fill_blocks(
            ({"input_ids": labels, "labels": labels, "row_index": torch.tensor([index])} for index, labels in kept),
            block_length, split_examples=False)]  # the packer reads lengths only

    def _each_example(self):
        """(row, its example or drop reason), PLAN_ROWS rows' pixels in memory at a time."""
        for start in range(0, len(self.rows), PLAN_ROWS):
            indices = range(start, min(start + PLAN_ROWS, len(self.rows)))
            yield from zip(indices, self._examples(indices))

    def _examples(self, indices) -> list[VisionExample | str]:
        rows = [self.rows[int(index)] for index in indices]
        return self.processing.examples([row["messages"] for row in rows], [row[IMAGES_FIELD] or [] for row in rows],
                                        **self.template_kwargs)

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return join_examples([{"input_ids": example.input_ids, "labels": example.labels,
                               "pixel_values": example.pixel_values, "image_grid_thw": example.image_grid_thw,
                               "mrope_positions": example.mrope_positions,
                               "num_images": torch.tensor([len(example.image_grid_thw)])}
                              for example in self._examples(self.plan[index])])

    def select(self, indices) -> VisionEvalBlocks:
        """The blocks at `indices` (a rank's share of the eval set)."""
        chosen = object.__new__(VisionEvalBlocks)
        chosen.__dict__.update(self.__dict__, plan=[self.plan[index] for index in indices])
        return chosen

    @property
    def conversations(self) -> int:
        """The conversations packed (`mixture.describe_eval` writes the eval line of these blocks too)."""
        return sum(map(len, self.plan))
