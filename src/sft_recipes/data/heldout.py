"""Held-out eval rows chosen by a hash of each row's content (`test_split_size`).

A row is held out when the SHA-1 of its canonical JSON (sorted keys, no whitespace), read as a
number in [0, 1), is below `test_split_size`. The decision depends on the row alone: not on its
position, the seed, the world size, the dataloader workers or how far a resumed run had got. So
the same rows are held out in every run of a recipe, a streamed run holds out exactly the rows a
map-style run would, and a row is never both trained on and evaluated (duplicates of a row go to
the same side). The held-out share is `test_split_size` in expectation, not exactly. A stream read
for packed blocks keeps its bad rows flagged (`ROW_PROBLEM`): the flag is not content, and a bad
row is never held out (the training stream counts it where it is read).
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

from datasets import Dataset, IterableDataset

from sft_recipes.data.rows import ROW_PROBLEM

# A streamed source is not read to its end up front: its eval rows are the held-out rows among its first rows.
STREAMED_EVAL_SCAN_ROWS = 20_000
_HASH_BYTES = 8


def row_position(row: dict[str, Any]) -> float:
    """Where the row's content hashes to in [0, 1)."""
    row = {key: value for key, value in row.items() if key != ROW_PROBLEM}
    canonical = json.dumps(row, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    digest = hashlib.sha1(canonical.encode("utf-8")).digest()[:_HASH_BYTES]
    return int.from_bytes(digest, "big") / 2 ** (8 * _HASH_BYTES)


def is_held_out(row: dict[str, Any], test_split_size: float) -> bool:
    return not row.get(ROW_PROBLEM) and row_position(row) < test_split_size


def is_training_row(row: dict[str, Any], test_split_size: float) -> bool:
    return not is_held_out(row, test_split_size)


def split_held_out(dataset: Dataset | IterableDataset, test_split_size: float
                   ) -> tuple[Dataset | IterableDataset, Dataset]:
    """(training rows, held-out eval rows). A stream stays a stream, filtered as it is read; its eval
    rows are the held-out ones among its first STREAMED_EVAL_SCAN_ROWS rows."""
    if isinstance(dataset, IterableDataset):
        train = dataset.filter(functools.partial(is_training_row, test_split_size=test_split_size))
        held_out = [row for row in dataset.take(STREAMED_EVAL_SCAN_ROWS) if is_held_out(row, test_split_size)]
        return train, Dataset.from_list(held_out)
    flags = [is_held_out(row, test_split_size) for row in dataset]
    train = dataset.select([index for index, flag in enumerate(flags) if not flag])
    return train, dataset.select([index for index, flag in enumerate(flags) if flag])
