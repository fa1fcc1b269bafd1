#!/usr/bin/env python3
"""Training throughput on CPU: padded vs packed batches, tiny Llama, same examples, one epoch each.

    python benchmarks/train_throughput_cpu.py          # ~2 minutes on one core
    python benchmarks/train_throughput_cpu.py --quick  # seconds: a smoke run

Every strategy trains the same tiny random Llama-3.1-architecture model (``ensure_tiny("llama")``,
its own 512-token BPE) with TRL's ``SFTTrainer`` for one epoch over the same alpaca rows (the real
ones in shared/realworld + data/samples/alpaca.jsonl, in the Llama seed's prompt format), so each
sees the same real tokens; per step the budget is 4 rows of ``--max-length`` tokens:

* seed 000: every row padded to ``max_length`` (``padding="max_length"``, stacked by the default collate);
* dynamic padding: TRL's default collator, rows padded to the longest of the batch;
* TRL packed: ``packing=True, packing_strategy='bfd'`` (padding-free: a batch of 4 packed rows
  flattened into one row with position ids restarting per example);
* ours: ``pack_blocks`` (examples split at block edges, every block full) and
  ``BlockDiagonalCollator`` -> ``[4, max_length]`` block-diagonal rows.

Only ``trainer.train()`` is timed; the strategies run in turns (``--repeats`` rounds, fastest run
kept), in one process pinned to CPU 0 with one torch thread, so they share whatever load the
machine has. Attention is sdpa: transformers turns the restarting position ids into a
block-diagonal mask, so a TRL padding-free batch attends over one ``4 x max_length`` row (4x the
attention work of four rows; flash-attention varlen on a GPU would not pay that).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import SINGLE_THREAD_ENV, environment_header, markdown_table, pin_to_cpus, scratch_dir  # noqa: E402

BATCH = 4
PADDED = "seed 000: pad every row to max_length"


def tokenized_examples(tokenizer, rows: list[dict[str, str]], max_length: int) -> list[dict[str, list[int]]]:
    """The seed's text per row, tokenized once without padding; labels = input_ids, as in the seed."""
    from reference_recipes import seed000_tokenize

    examples = []
    for row in rows:
        padded = seed000_tokenize(tokenizer, row, max_length)
        ids = [token for token, keep in zip(padded["input_ids"], padded["attention_mask"]) if keep]
        examples.append({"input_ids": ids, "labels": list(ids)})
    return examples


def stack_padded(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What the seed's DataLoader does with its ``padding="max_length"`` rows."""
    import torch

    return {key: torch.tensor([row[key] for row in rows]) for key in ("input_ids", "attention_mask", "labels")}


def strategies(tokenizer, rows: list[dict[str, str]], max_length: int) -> dict[str, dict[str, Any]]:
    """Per strategy: the dataset, the collator (None = TRL's) and the SFTConfig overrides."""
    from datasets import Dataset

    from reference_recipes import seed000_tokenize
    from sft_recipes.data.blocks import fill_blocks
    from sft_recipes.data.collator import BlockDiagonalCollator

    examples = tokenized_examples(tokenizer, rows, max_length)
    padded = [seed000_tokenize(tokenizer, row, max_length) for row in rows]
    blocks = list(fill_blocks(examples, max_length, split_examples=True))
    prepared = {"dataset_kwargs": {"skip_prepare_dataset": True}, "remove_unused_columns": False}
    return {
        PADDED: {
            "dataset": Dataset.from_list([dict(p) for p in padded]), "collator": stack_padded, "config": prepared},
        "dynamic padding (TRL default collator)": {
            "dataset": Dataset.from_list(examples), "collator": None, "config": {}},
        "TRL packing='bfd' (padding-free)": {
            "dataset": Dataset.from_list(examples), "collator": None,
            "config": {"packing": True, "packing_strategy": "bfd"}},
        "ours: pack_blocks + BlockDiagonalCollator": {
            "dataset": Dataset.from_list(blocks),
            "collator": BlockDiagonalCollator(max_length, tokenizer.pad_token_id, block_per_row=True),
            "config": prepared},
    }


def train_once(model_path: str, tokenizer, strategy: dict[str, Any], max_length: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, PrinterCallback
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False  # transformers skips packed-sequence masks when a cache exists
    args = SFTConfig(
        output_dir=scratch_dir(), per_device_train_batch_size=BATCH, num_train_epochs=1,
        learning_rate=1e-3, lr_scheduler_type="constant", logging_strategy="no", save_strategy="no",
        report_to="none", use_cpu=True, bf16=False, max_length=max_length, dataloader_num_workers=0,
        disable_tqdm=True, seed=0, **strategy["config"],
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=strategy["dataset"], processing_class=tokenizer,
                         data_collator=strategy["collator"])
    trainer.remove_callback(PrinterCallback)  # it prints the end-of-training metrics into the report
    batches = list(trainer.get_train_dataloader())
    slots = sum(batch["input_ids"].numel() for batch in batches)
    start = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "steps": result.global_step, "slots": slots, "loss": result.training_loss}


def report(options: argparse.Namespace, argv: list[str]) -> str:
    import datasets
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from corpus import alpaca_rows
    from sft_recipes.tiny import ensure_tiny

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    model_path = ensure_tiny("llama")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token  # the Llama seed's own fix
    rows = alpaca_rows()[: options.rows]
    real_tokens = sum(len(e["input_ids"]) for e in tokenized_examples(tokenizer, rows, options.max_length))
    plans = strategies(tokenizer, rows, options.max_length)
    best: dict[str, dict[str, Any]] = {}
    for round_index in range(options.repeats):
        for name, plan in plans.items():
            if round_index > 0 and name == PADDED:
                continue  # the slowest by far: one run
            run = train_once(model_path, tokenizer, plan, options.max_length)
            if name not in best or run["seconds"] < best[name]["seconds"]:
                best[name] = run

    padded = best[PADDED]["seconds"]
    dynamic = best["dynamic padding (TRL default collator)"]["seconds"]
    table = [
        [name, run["steps"], f"{run['slots']:,}", f"{real_tokens / run['slots']:.1%}", f"{run['seconds']:.1f}",
         f"{real_tokens / run['seconds']:,.0f}", f"{padded / run['seconds']:.2f}x", f"{dynamic / run['seconds']:.2f}x",
         f"{run['loss']:.3f}"]
        for name, run in best.items()
    ]
    return "\n".join([
        environment_header("Training throughput on CPU", argv),
        f"Tiny Llama-3.1 twin (hidden 64, 2 layers, vocab 512), fp32, sdpa, 1 torch thread on CPU 0; {len(rows)} "
        f"alpaca rows = {real_tokens:,} real tokens per epoch; batch {BATCH} x max_length {options.max_length}; "
        f"fastest of {options.repeats} runs (padded: 1).",
        "",
        markdown_table(["strategy", "steps", "token slots", "real / slots", "train seconds", "real tokens/s",
                        "vs padded", "vs dynamic", "mean loss"], table),
        "",
    ])


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few rows, short rows, one run")
    parser.add_argument("--rows", type=int, default=120, help="alpaca rows (700 are available)")
    parser.add_argument("--max-length", type=int, default=1024, help="the Llama seed's max_seq_len")
    parser.add_argument("--repeats", type=int, default=2)
    options = parser.parse_args(argv)
    if options.quick:
        options.rows, options.max_length, options.repeats = 16, 256, 1
    return options


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    options = parse_args(argv)
    if not options.quick:
        os.environ.update(SINGLE_THREAD_ENV)
        pin_to_cpus({0})
    print(report(options, [__file__, *argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
