#!/usr/bin/env python3
"""Data preparation throughput: raw conversations -> packed training blocks with assistant-only labels.

    python benchmarks/data_prep.py            # ~6 minutes on 2 cores
    python benchmarks/data_prep.py --quick    # seconds, in one process: a smoke run, numbers mean nothing

Each method reads the same in-memory ``datasets.Dataset`` of UltraChat-like conversations (see
``corpus.py``) and ends with what a training step consumes: blocks of ``--block`` tokens as tensors
with labels -100 outside the assistant replies, position ids restarting per example and cu_seqlens.

* ``seed``: the reference recipe's method (shared/seeds/001, reproduced in ``reference_recipes.py``):
  ``apply_chat_template(tokenize=True)`` of the whole conversation and, per assistant turn, of two
  prefixes; then its Python packing loop and ``_pack_block``.
* ``trl``: TRL 1.16's own dataset preparation, ``SFTTrainer._prepare_dataset`` with
  ``packing=True, packing_strategy='bfd'`` and ``assistant_only_loss=True`` -- TRL refuses that for
  a template it has no ``{% generation %}`` copy of, and then it is timed without masks (every token
  trained: a cheaper, different product) -- then TRL's padding-free collator, one packed row at a time.
* ``ours``: ``RankLocalBlockStream`` (``tokenize_conversations`` + ``fill_blocks``) and
  ``BlockDiagonalCollator``, exactly as ``scripts/sft.py`` runs them for ``pack_blocks: true``.
* ``ours:masking``: the masking stage alone (``tokenize_conversations`` over 256-row batches).
* ``limit``: the practical limit as the issue defines it -- render each conversation once, then one
  batched fast-tokenizer call with offsets (``tokenizer(texts, return_offsets_mapping=True)``,
  which also converts ids and offsets to Python lists); no masks, no packing.
* ``tokenizer only``: render once, then the Rust ``encode_batch`` alone, nothing converted to Python:
  the floor under every method here.

Each method lives in its own process pinned to CPU 0 (like ``taskset -c 0``) with one
tokenizer/torch thread, so its peak RSS is its own; the driver runs them one at a time, round
robin, so that load from other users of the machine falls on all of them alike, and keeps each
one's fastest run. 2-worker methods get CPUs 0 and 1. Throughput is the corpus's tokens (as that
template renders them) per second.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    SINGLE_THREAD_ENV,
    current_rss_mib,
    environment_header,
    markdown_table,
    peak_rss_mib,
    pin_to_cpus,
    scratch_dir,
)

ONE_CORE_METHODS = ("seed", "trl", "ours", "ours:masking", "limit", "tokenizer only")
TWO_WORKER_METHODS = ("seed x2", "trl x2", "ours x2")
QUICK_TWO_WORKER_METHODS = ("trl x2", "ours x2")  # seed x2 runs the same worker code as ours x2
SLOW_METHODS = ("seed", "seed x2")  # timed once: tens of seconds a run
RENDER_BATCH = 256

Run = Callable[[], Any]


# ---------------------------------------------------------------------------------------------
# The methods: each builds a callable that runs the whole preparation once, plus facts about it.


def load_inputs(options: argparse.Namespace, template: str):
    import datasets
    from datasets import Dataset
    from transformers.utils import logging as hf_logging

    from corpus import load_conversations, standin_tokenizer

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    tokenizer = standin_tokenizer(template, **options.tokenizer_args)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # as sft_recipes.loading.load_tokenizer does
    dataset = Dataset.from_list([{"messages": c} for c in load_conversations(Path(options.corpus))])
    return tokenizer, dataset


def seed_method(tokenizer, dataset, block: int, rank: int = 0, world_size: int = 1) -> tuple[Run, dict]:
    from datasets.distributed import split_dataset_by_node

    from reference_recipes import Seed001PackedBlocks

    shard = split_dataset_by_node(dataset, rank=rank, world_size=world_size)

    def run() -> int:
        return sum(1 for _ in Seed001PackedBlocks(tokenizer, block).blocks(shard)) - 1  # minus the ran_out block

    return run, {"assistant_masks": "yes (prefix renders)"}


def ours_method(tokenizer, dataset, block: int, rank: int = 0, world_size: int = 1) -> tuple[Run, dict]:
    from sft_recipes.data.blocks import RankLocalBlockStream, collate_blocks
    from sft_recipes.data.collator import BlockDiagonalCollator

    collate = collate_blocks(BlockDiagonalCollator(block, tokenizer.pad_token_id, block_per_row=True))

    def run() -> int:
        stream = RankLocalBlockStream(dataset, tokenizer, block, rank, world_size, split_examples=True)
        blocks = 0
        for item in stream:
            if item["stream_exhausted"]:
                break
            collate([item])
            blocks += 1
        return blocks

    return run, {"assistant_masks": "yes"}


def ours_masking_method(tokenizer, dataset, block: int) -> tuple[Run, dict]:
    from sft_recipes.data.masking import tokenize_conversations

    def run() -> int:
        rows = 0
        for batch in dataset.iter(batch_size=RENDER_BATCH):
            rows += len(tokenize_conversations(tokenizer, batch["messages"])["input_ids"])
        return rows

    return run, {"assistant_masks": "yes (masks only, not packed)"}


def limit_method(tokenizer, dataset, block: int) -> tuple[Run, dict]:
    def run() -> int:
        tokens = 0
        for batch in dataset.iter(batch_size=RENDER_BATCH):
            texts = tokenizer.apply_chat_template(batch["messages"], tokenize=False)
            encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
            tokens += sum(map(len, encoded["input_ids"]))
        return tokens

    return run, {"assistant_masks": "no (render + tokenize only)"}


def tokenizer_only_method(tokenizer, dataset, block: int) -> tuple[Run, dict]:
    backend = tokenizer.backend_tokenizer

    def run() -> int:
        tokens = 0
        for batch in dataset.iter(batch_size=RENDER_BATCH):
            texts = tokenizer.apply_chat_template(batch["messages"], tokenize=False)
            tokens += sum(map(len, backend.encode_batch(texts, add_special_tokens=False)))
        return tokens

    return run, {"assistant_masks": "no (render + Rust encode only)"}


def trl_method(tokenizer, dataset, block: int, num_proc: int | None = None) -> tuple[Run, dict]:
    """TRL's preparation: the trainer is built on 2 rows, then ``_prepare_dataset`` runs on the corpus."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=len(tokenizer))
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)

    def trainer_for(assistant_only_loss: bool) -> SFTTrainer:
        args = SFTConfig(output_dir=scratch_dir(), use_cpu=True, bf16=False, report_to="none", packing=True,
                         packing_strategy="bfd", max_length=block, assistant_only_loss=assistant_only_loss,
                         dataset_num_proc=num_proc)
        return SFTTrainer(model=model, args=args, train_dataset=dataset.select(range(2)), processing_class=tokenizer)

    facts: dict[str, Any] = {"assistant_masks": "yes ({% generation %} training template)"}
    try:
        trainer = trainer_for(assistant_only_loss=True)
    except ValueError as refusal:
        facts = {"assistant_masks": "no: refused", "note": str(refusal).split(". ")[0]}
        trainer = trainer_for(assistant_only_loss=False)

    def run() -> int:
        packed = trainer._prepare_dataset(dataset, tokenizer, trainer.args, packing=True, formatting_func=None,
                                          dataset_name="train")
        rows = 0
        for row in packed:
            trainer.data_collator([row])
            rows += 1
        return rows

    return run, facts


def two_workers_method(method: str, options: argparse.Namespace, template: str, tokenizer, dataset
                       ) -> tuple[Run, dict]:
    """Two processes, one per CPU: per-rank shards for seed/ours (as in training), num_proc=2 for TRL."""
    if method == "trl":
        return trl_method(tokenizer, dataset, options.block, num_proc=2)
    return RankWorkers(method, options, template), {"assistant_masks": "yes"}


class RankWorkers:
    """Two worker processes, ranks 0 and 1 of the shard, each on its own CPU; calling runs both once."""

    def __init__(self, method: str, options: argparse.Namespace, template: str):
        # Spawned, not forked: a fork of a process whose tokenizer threads hold a lock can hang.
        context = multiprocessing.get_context("spawn")
        self.done = context.Queue()
        self.workers = []
        for rank in (0, 1):
            go = context.Queue()
            process = context.Process(target=_rank_worker, args=(method, rank, options, template, go, self.done))
            process.start()
            self.workers.append((process, go))
        self._wait_for_both()  # ready: imports and inputs loaded, not timed

    def __call__(self) -> None:
        for _, go in self.workers:
            go.put(True)
        self._wait_for_both()

    def _wait_for_both(self) -> None:
        for _ in self.workers:
            while True:
                try:
                    self.done.get(timeout=1.0)
                    break
                except queue.Empty:
                    for process, _ in self.workers:
                        if not process.is_alive():
                            raise RuntimeError(f"a 2-worker benchmark process exited with code {process.exitcode}")

    def close(self) -> None:
        for process, go in self.workers:
            go.put(False)
            process.join()


def _rank_worker(method: str, rank: int, options: argparse.Namespace, template: str, go, done) -> None:
    """One of two worker processes: its rank's shard, on its own CPU, once per ``go`` signal."""
    os.environ.update(SINGLE_THREAD_ENV)  # before the tokenizer library starts its thread pool
    pin_to_cpus({rank})
    tokenizer, dataset = load_inputs(options, template)
    run, _ = (seed_method if method == "seed" else ours_method)(tokenizer, dataset, options.block, rank, 2)
    done.put("ready")
    while go.get():
        run()
        done.put("done")


ONE_CORE_BUILDERS = {
    "seed": seed_method,
    "trl": trl_method,
    "ours": ours_method,
    "ours:masking": ours_masking_method,
    "limit": limit_method,
    "tokenizer only": tokenizer_only_method,
}


class Measured:
    """One method, set up and ready: ``time_once()`` runs it, ``summary()`` says what it cost."""

    def __init__(self, method: str, template: str, options: argparse.Namespace):
        tokenizer, dataset = load_inputs(options, template)
        if method in TWO_WORKER_METHODS:
            self.run, self.facts = two_workers_method(method.removesuffix(" x2"), options, template, tokenizer,
                                                      dataset)
        else:
            self.run, self.facts = ONE_CORE_BUILDERS[method](tokenizer, dataset, options.block)
        self.baseline_rss_mib = current_rss_mib()
        self.best = float("inf")
        self.produced = None

    def time_once(self) -> float:
        start = time.perf_counter()
        self.produced = self.run()
        self.best = min(self.best, time.perf_counter() - start)
        return self.best

    def summary(self) -> dict[str, Any]:
        if isinstance(self.run, RankWorkers):
            self.run.close()
        return {"seconds": self.best, "produced": self.produced, "peak_rss_mib": peak_rss_mib(),
                "baseline_rss_mib": self.baseline_rss_mib, **self.facts}


# ---------------------------------------------------------------------------------------------
# Labels: ours against the seed's method


def label_check(template: str, options: argparse.Namespace) -> dict[str, Any]:
    """Per conversation (same ids, same mask), then per full packed block (same tensors)."""
    import torch

    from reference_recipes import Seed001PackedBlocks
    from sft_recipes.data.blocks import IGNORE_INDEX, fill_blocks
    from sft_recipes.data.masking import tokenize_conversations
    from sft_recipes.data.collator import BlockDiagonalCollator

    tokenizer, dataset = load_inputs(options, template)
    block = options.block
    conversations = dataset["messages"]
    seed = Seed001PackedBlocks(tokenizer, block)
    seed_rows = [seed._tokenize_sft(messages) for messages in conversations]
    ours = tokenize_conversations(tokenizer, conversations)
    same_ids = same_masks = 0
    for (seed_ids, seed_mask), ids, mask in zip(seed_rows, ours["input_ids"], ours["assistant_masks"]):
        same_ids += seed_ids == ids
        same_masks += seed_ids == ids and [int(bit) for bit in seed_mask] == mask

    examples = [
        {"input_ids": ids, "labels": [t if keep else IGNORE_INDEX for t, keep in zip(ids, mask)]}
        for ids, mask in zip(ours["input_ids"], ours["assistant_masks"])
    ]
    collator = BlockDiagonalCollator(block, tokenizer.pad_token_id, block_per_row=True)
    ours_blocks = [collator([b]) for b in fill_blocks(examples, block) if len(b["input_ids"]) == block]
    seed._tokenize_sft = lambda index: seed_rows[index]  # its packing loop, on the rows tokenized above
    seed_blocks = [b for b, ran_out in seed.blocks({"messages": i} for i in range(len(seed_rows))) if not ran_out]
    same_blocks = 0
    for mine, (ids, labels, positions, cu_seqlens, _, _) in zip(ours_blocks, seed_blocks):
        # Position 0 of a block is never a target of the shifted loss: the seed keeps its label, we mask it.
        same_blocks += (
            torch.equal(mine["input_ids"], ids) and torch.equal(mine["labels"][:, 1:], labels[:, 1:])
            and torch.equal(mine["position_ids"], positions) and torch.equal(mine["cu_seq_lens_q"], cu_seqlens)
        )
    total_tokens = sum(map(len, ours["input_ids"]))
    return {
        "conversations": len(conversations),
        "same_ids": same_ids,
        "same_masks": same_masks,
        "full_blocks": len(ours_blocks),
        "same_blocks": same_blocks,
        "seed_dropped_tokens": total_tokens - len(seed_blocks) * block,
        "supervised_fraction": sum(map(sum, ours["assistant_masks"])) / total_tokens,
    }


# ---------------------------------------------------------------------------------------------
# Child processes: one per method, driven over stdin/stdout


def child_main(options: argparse.Namespace) -> None:
    pin_to_cpus({int(cpu) for cpu in options.cpus.split(",")})
    if options.child == "check":
        print(json.dumps(label_check(options.template, options)), flush=True)
        return
    measured = Measured(options.child, options.template, options)
    print(json.dumps({"ready": True}), flush=True)
    for command in sys.stdin:
        if command.strip() == "run":
            print(json.dumps({"seconds": measured.time_once()}), flush=True)
        else:
            break
    print(json.dumps(measured.summary()), flush=True)


class ChildMethod:
    """A method in its own process, pinned to ``cpus``."""

    def __init__(self, job: str, template: str, options: argparse.Namespace, cpus: str):
        self.job = job
        self.stderr = tempfile.TemporaryFile(mode="w+")
        command = [sys.executable, __file__, "--child", job, "--template", template, "--corpus", options.corpus,
                   "--block", str(options.block), "--cpus", cpus, *(["--quick"] if options.quick else [])]
        self.process = subprocess.Popen(command, env={**os.environ, **SINGLE_THREAD_ENV}, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.stderr, text=True)

    def reply(self) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            self.stderr.seek(0)
            raise RuntimeError(f"benchmark child {self.job!r} failed:\n{self.stderr.read()[-4000:]}")
        return json.loads(line)

    def time_once(self) -> float:
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        return self.reply()["seconds"]

    def summary(self) -> dict[str, Any]:
        self.process.stdin.write("stop\n")
        self.process.stdin.flush()
        summary = self.reply()
        self.process.wait()
        return summary


def measure_round_robin(methods: tuple[str, ...], template: str, options: argparse.Namespace, cpus: str
                        ) -> dict[str, dict[str, Any]]:
    """Set every method up, then time them in turns; the fastest run of each counts."""
    if options.in_process:
        runners = {method: Measured(method, template, options) for method in methods}
    else:
        runners = {method: ChildMethod(method, template, options, cpus) for method in methods}
        for runner in runners.values():
            runner.reply()  # ready
    for round_index in range(options.repeats):
        for method, runner in runners.items():
            if round_index == 0 or method not in SLOW_METHODS:
                runner.time_once()
    return {method: runner.summary() for method, runner in runners.items()}


def run_check(template: str, options: argparse.Namespace) -> dict[str, Any]:
    if options.in_process:
        return label_check(template, options)
    child = ChildMethod("check", template, options, "0")
    result = child.reply()
    child.process.wait()
    return result


# ---------------------------------------------------------------------------------------------
# The report


def report(options: argparse.Namespace, argv: list[str]) -> str:
    from corpus import cached_ultrachat_like, load_conversations, standin_tokenizer

    options.corpus = str(cached_ultrachat_like(options.conversations, seed=0))
    conversations = load_conversations(Path(options.corpus))
    words = sum(len(m["content"].split()) for c in conversations for m in c)
    lines = [environment_header("Data preparation throughput", argv)]
    corpus_rows, speed_tables, check_rows, two_worker_rows = [], [], [], []
    for template in options.templates:
        tokenizer = standin_tokenizer(template, **options.tokenizer_args)  # built here once, before any child
        results = measure_round_robin(ONE_CORE_METHODS, template, options, cpus="0")
        tokens = results["limit"]["produced"]
        corpus_rows.append([template, len(tokenizer), len(conversations), f"{tokens:,}",
                            f"{tokens / len(conversations):.0f}", f"{tokens / words:.2f}"])
        speed = {method: tokens / r["seconds"] for method, r in results.items()}
        rows = [
            [f"`{method}`", r["assistant_masks"], f"{speed[method] / 1e3:,.0f}k",
             f"{speed[method] / speed['seed']:.1f}x", f"{speed[method] / speed['trl']:.2f}x",
             f"{speed['limit'] / speed[method]:.2f}x", f"{r['peak_rss_mib']:.0f} ({r['baseline_rss_mib']:.0f})",
             r.get("note", "")]
            for method, r in results.items()
        ]
        speed_tables.append((template, rows))
        if template in options.check_templates:
            check = run_check(template, options)
            n = check["conversations"]
            check_rows.append([template, f"{check['same_ids']}/{n}", f"{check['same_masks']}/{n}",
                               f"{check['same_blocks']}/{check['full_blocks']}", f"{check['seed_dropped_tokens']:,}",
                               f"{check['supervised_fraction']:.1%}"])
        if template in options.two_worker_templates:
            methods = QUICK_TWO_WORKER_METHODS if options.quick else TWO_WORKER_METHODS
            for method, r in measure_round_robin(methods, template, options, cpus="0,1").items():
                total = tokens / r["seconds"]
                two_worker_rows.append([template, f"`{method}`", f"{total / 1e3:,.0f}k",
                                        f"{total / speed[method.removesuffix(' x2')]:.2f}x"])

    lines += [
        f"Corpus: {len(conversations)} UltraChat-like conversations (`corpus.ultrachat_like`, seed 0), "
        f"{words:,} words; blocks of {options.block} tokens; fastest of {options.repeats} runs per method "
        f"(the seed's method: 1 run).",
        "",
        markdown_table(["template", "stand-in vocab", "conversations", "tokens", "tokens/conv", "tokens/word"],
                       corpus_rows),
        "",
    ]
    for template, rows in speed_tables:
        lines += [f"One core, template `{template}`:", "",
                  markdown_table(["method", "assistant-only labels", "tokens/s", "vs seed", "vs trl", "limit / this",
                                  "peak RSS MiB (before run)", "note"], rows), ""]
    if check_rows:
        lines += ["Ours against the seed's method: per conversation (same input_ids, same mask) and per full "
                  "packed block (same input_ids, labels, position_ids, cu_seqlens):", "",
                  markdown_table(["template", "same input_ids", "same masks", "same blocks",
                                  "tokens the seed drops at the end", "supervised tokens"], check_rows), ""]
    if two_worker_rows:
        lines += ["Two workers (CPUs 0 and 1), total tokens/s:", "",
                  markdown_table(["template", "method", "tokens/s", "vs the same method on one core"], two_worker_rows),
                  ""]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny corpus and tokenizer, in one process")
    parser.add_argument("--conversations", type=int, default=300)
    parser.add_argument("--templates", default="llama3.1,qwen3,qwen3-trl")
    parser.add_argument("--check-templates", default="llama3.1,qwen3", help="compare labels with the seed's")
    parser.add_argument("--two-worker-templates", default="llama3.1")
    parser.add_argument("--block", type=int, default=32768, help="tokens per packed block (the seed's SEQ_LEN)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--in-process", action="store_true", help="no child processes (RSS is not per method)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--template", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--cpus", default="0", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    options.tokenizer_args = {}
    if options.quick:
        options.conversations, options.block, options.repeats, options.in_process = 8, 2048, 1, True
        options.templates = options.check_templates = options.two_worker_templates = "llama3.1"
        options.tokenizer_args = {"training_conversations": 30, "vocab_size": 2000}
    for name in ("templates", "check_templates", "two_worker_templates"):
        setattr(options, name, [value for value in getattr(options, name).split(",") if value])
    return options


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    options = parse_args(argv)
    if options.child:
        child_main(options)
        return 0
    print(report(options, [__file__, *argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
