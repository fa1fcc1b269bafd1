#!/usr/bin/env python3
"""Packing efficiency: real tokens / token slots, and the compute spent on padding, per batching strategy.

    python benchmarks/packing_efficiency.py           # ~1-2 minutes
    python benchmarks/packing_efficiency.py --quick   # seconds: a smoke run

Every strategy runs its real code on the same tokenized examples (the Llama-3 stand-in tokenizer
of ``corpus.py``):

* alpaca-like rows (the real alpaca rows in data/realworld + data/samples/alpaca.jsonl, in the
  Llama seed's prompt format) at 1024 tokens: the seed's ``padding="max_length"`` (shared/seeds/000),
  dynamic padding (TRL's ``DataCollatorForLanguageModeling``, batch 4), ``trl.pack_dataset`` bfd and
  bfd_split, ours (``fill_blocks``) splitting examples at block edges and keeping them whole;
* UltraChat-like conversations at 8192 and 32768 tokens: the same, plus the Qwen seed's packing
  loop (shared/seeds/001), which splits like ours but drops the last partial block.

Slots are ``rows x max_length`` for fixed-shape rows and the padded batch for dynamic padding.
TRL's padding-free collator flattens a batch of packed rows into one row without padding, so it
wastes no slot; what it gives up instead is a fixed step size (shown as tokens per step of 4 rows).
Wasted compute counts the 6·N training FLOPs per slot of Llama-3.1-8B (N = 8.03e9) spent on padding,
per million real tokens; attention FLOPs are left out.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment_header, markdown_table  # noqa: E402

LLAMA_8B_PARAMETERS = 8.03e9
BATCH = 4


def strategy_row(name: str, block: int, rows: int, slots: int, real: int, lost: int, note: str = "") -> list[Any]:
    padding = slots - real
    wasted_pflop = 6 * LLAMA_8B_PARAMETERS * padding / real * 1e6 / 1e15 if real else 0.0
    return [name, rows, f"{slots:,}", f"{real:,}", f"{real / slots:.2%}", f"{wasted_pflop:,.1f}", f"{lost:,}", note]


def pad_to_max(lengths: Sequence[int], block: int) -> list[Any]:
    real = sum(min(n, block) for n in lengths)
    return strategy_row("pad every row to max_length", block, len(lengths), len(lengths) * block, real,
                        sum(lengths) - real)


def dynamic_padding(examples: list[dict[str, list[int]]], block: int, pad_token_id: int) -> list[Any]:
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collator = DataCollatorForLanguageModeling(pad_token_id=pad_token_id)
    truncated = [{"input_ids": e["input_ids"][:block]} for e in examples]
    slots = sum(collator(truncated[i : i + BATCH])["input_ids"].numel() for i in range(0, len(truncated), BATCH))
    real = sum(len(e["input_ids"]) for e in truncated)
    lost = sum(len(e["input_ids"]) for e in examples) - real
    return strategy_row(f"dynamic padding (TRL collator, batch {BATCH})", block, len(examples), slots, real, lost)


def trl_packing(examples: list[dict[str, list[int]]], block: int, strategy: str, pad_token_id: int
                ) -> list[list[Any]]:
    from datasets import Dataset
    from trl import pack_dataset
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    dataset = Dataset.from_list([{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples])
    packed = pack_dataset(dataset, block, strategy)
    lengths = [len(ids) for ids in packed["input_ids"]]
    real, total = sum(lengths), sum(len(e["input_ids"]) for e in examples)
    fixed = strategy_row(f"`trl.pack_dataset` {strategy}, rows padded to max_length", block, len(lengths),
                         len(lengths) * block, real, total - real)
    # What SFTTrainer really trains on: padding-free batches of BATCH packed rows flattened into one row.
    collator = DataCollatorForLanguageModeling(pad_token_id=pad_token_id, padding_free=True)
    rows = list(packed)
    steps = [collator(rows[i : i + BATCH])["input_ids"].numel() for i in range(0, len(rows), BATCH)]
    budget = BATCH * block
    note = f"tokens per step: {min(steps) / budget:.0%}-{max(steps) / budget:.0%} of {budget:,}"
    flat = strategy_row(f"`trl.pack_dataset` {strategy}, padding-free batch of {BATCH}", block, len(lengths),
                        sum(steps), real, total - real, note)
    return [fixed, flat]


def ours(examples: list[dict[str, list[int]]], block: int, split_examples: bool, window: int | None = None
         ) -> list[Any]:
    from sft_recipes.data.blocks import PACKING_WINDOW, fill_blocks

    window = window or PACKING_WINDOW
    rows = real = not_full = last = 0
    for packed in fill_blocks(examples, block, split_examples=split_examples, window=window):
        rows, last = rows + 1, len(packed["input_ids"])
        real += last
        not_full += last < block
    if split_examples:
        name = "ours, `pack_blocks` split at block edges"
    elif window == 1:
        name = "ours, `pack_blocks` whole examples, arrival order (`packing_window: 1`)"
    else:
        name = f"ours, `pack_blocks` whole examples, best fit over {window} waiting (default)"
    partial = not_full - (last < block)
    note = (f"all blocks but the last are full (last {last / block:.0%} full)" if not partial
            else f"{not_full} of {rows} blocks not full")
    return strategy_row(name, block, rows, rows * block, real, sum(len(e["input_ids"]) for e in examples) - real, note)


def seed001(examples: list[dict[str, list[int]]], block: int, tokenizer) -> list[Any]:
    """The seed's own packing loop, fed the examples' tokens instead of re-tokenizing them."""
    from reference_recipes import Seed001PackedBlocks

    seed = Seed001PackedBlocks(tokenizer, block)
    seed._tokenize_sft = lambda index: (examples[index]["input_ids"], [True] * len(examples[index]["input_ids"]))
    blocks = [b for b, ran_out in seed.blocks({"messages": i} for i in range(len(examples))) if not ran_out]
    real = len(blocks) * block
    return strategy_row("seed 001 packing loop (split, last partial block dropped)", block, len(blocks),
                        len(blocks) * block, real, sum(len(e["input_ids"]) for e in examples) - real)


def alpaca_examples(tokenizer, rows: list[dict[str, str]], block: int) -> tuple[list[list[Any]], list[dict]]:
    """Seed 000's pad-to-max_length rows, and the same texts unpadded for the other strategies."""
    from reference_recipes import seed000_tokenize

    padded = [seed000_tokenize(tokenizer, row, block) for row in rows]
    real = sum(sum(p["attention_mask"]) for p in padded)
    seed_row = strategy_row("seed 000: `padding=\"max_length\"`", block, len(padded), len(padded) * block, real, 0,
                            "longer rows truncated; none here")
    examples = []
    for p in padded:
        ids = [t for t, keep in zip(p["input_ids"], p["attention_mask"]) if keep]
        examples.append({"input_ids": ids, "labels": ids})
    return [seed_row], examples


def conversation_examples(tokenizer, conversations) -> list[dict[str, list[int]]]:
    from sft_recipes.data.blocks import IGNORE_INDEX
    from sft_recipes.data.masking import tokenize_conversations

    columns = tokenize_conversations(tokenizer, conversations)
    return [
        {"input_ids": ids, "labels": [t if keep else IGNORE_INDEX for t, keep in zip(ids, mask)]}
        for ids, mask in zip(columns["input_ids"], columns["assistant_masks"])
    ]


def report(options: argparse.Namespace, argv: list[str]) -> str:
    import datasets

    from corpus import alpaca_rows, ultrachat_like, standin_tokenizer

    datasets.disable_progress_bars()
    tokenizer = standin_tokenizer("llama3.1", **options.tokenizer_args)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # the Llama seed's own fix
    pad = tokenizer.pad_token_id
    headers = ["strategy", "rows", "token slots", "real tokens", "efficiency", "padding PFLOP / 1M real tokens (8B)",
               "tokens lost", "note"]
    lines = [environment_header("Packing efficiency", argv)]

    rows = alpaca_rows()[: options.alpaca_rows]
    table, examples = alpaca_examples(tokenizer, rows, 1024)
    lengths = [len(e["input_ids"]) for e in examples]
    table += [dynamic_padding(examples, 1024, pad), *trl_packing(examples, 1024, "bfd", pad),
              *trl_packing(examples, 1024, "bfd_split", pad), ours(examples, 1024, True), ours(examples, 1024, False, 1),
              ours(examples, 1024, False)]
    lines += [f"Alpaca-like: {len(rows)} real alpaca rows in the Llama seed's prompt format, {sum(lengths):,} tokens "
              f"(mean {sum(lengths) / len(lengths):.0f}, max {max(lengths)}), max_length 1024:", "",
              markdown_table(headers, table), ""]

    conversations = ultrachat_like(options.conversations, seed=0)
    examples = conversation_examples(tokenizer, conversations)
    lengths = [len(e["input_ids"]) for e in examples]
    for block in options.blocks:
        table = [pad_to_max(lengths, block), dynamic_padding(examples, block, pad),
                 *trl_packing(examples, block, "bfd", pad), *trl_packing(examples, block, "bfd_split", pad),
                 seed001(examples, block, tokenizer), ours(examples, block, True), ours(examples, block, False, 1),
                 ours(examples, block, False)]
        lines += [f"UltraChat-like: {len(examples)} conversations, {sum(lengths):,} tokens (mean "
                  f"{sum(lengths) / len(lengths):.0f}, max {max(lengths)}), max_length {block}:", "",
                  markdown_table(headers, table), ""]

    # One rank's share of the Qwen recipe's data: the tail block a stream ends with is then what it is there.
    rank_share = random.Random(0).choices(examples, k=options.rank_conversations)
    lengths = [len(e["input_ids"]) for e in rank_share]
    for block in options.blocks:
        table = [*trl_packing(rank_share, block, "bfd", pad)[:1], seed001(rank_share, block, tokenizer),
                 ours(rank_share, block, True), ours(rank_share, block, False, 1), ours(rank_share, block, False)]
        lines += [f"UltraChat-like at the Qwen recipe's scale: the {len(examples)} conversations resampled to "
                  f"{len(rank_share):,} (one rank's share of UltraChat 200k `train_sft`, 207,865 conversations, over "
                  f"8 GPUs), {sum(lengths):,} tokens, max_length {block}:", "", markdown_table(headers, table), ""]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few rows and a small tokenizer")
    parser.add_argument("--conversations", type=int, default=1000)
    parser.add_argument("--alpaca-rows", type=int, default=None, help="default: all 700")
    parser.add_argument("--blocks", default="8192,32768")
    parser.add_argument("--rank-conversations", type=int, default=26_000,
                        help="conversations resampled for the recipe-scale table (one rank's share)")
    options = parser.parse_args(argv)
    options.blocks = [int(block) for block in options.blocks.split(",")]
    options.tokenizer_args = {}
    if options.quick:
        options.conversations, options.alpaca_rows, options.blocks, options.rank_conversations = 12, 40, [4096], 60
        options.tokenizer_args = {"training_conversations": 30, "vocab_size": 2000}
    return options


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print(report(parse_args(argv), [__file__, *argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
