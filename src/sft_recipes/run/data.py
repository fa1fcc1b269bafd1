"""Rows -> what the trainer trains on: the train dataset (or packed block stream), its collator, the eval
rows, the report. Every recipe's data is read by `data/mixture.py`: one dataset is a one-entry mixture."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from datasets import Dataset, IterableDataset

from sft_recipes.data.audit import audit_dataset, format_report
from sft_recipes.data.blocks import RankLocalBlockStream, collate_blocks
from sft_recipes.data.collator import BlockDiagonalCollator
from sft_recipes.data.formats import CHAT_FORMATS
from sft_recipes.data.mixture import (
    SourceData, build_source_data, describe_eval, refuse_eval_without_answers, token_counts,
)
from sft_recipes.data.passes import PackedPasses, plan_passes
from sft_recipes.data.report import DataReport, MixtureReport
from sft_recipes.data.sources import load_checked_dataset
from sft_recipes.data.stream_reads import StreamedRowDropsCallback
from sft_recipes.data.vision import VisionBlockCollator, VisionBlockStream, VisionProcessing
from sft_recipes.data.vision_eval import VisionEvalBlocks
from sft_recipes.distributed import prepared_once_per_cache
from sft_recipes.errors import RecipeError
from sft_recipes.lint import where_set
from sft_recipes.reporting.samples import Prompt, sample_prompts_for_run
from sft_recipes.reporting.vision_samples import prepared_prompts
from sft_recipes.run.setup import Run


@dataclass
class RunData:
    train: Dataset | IterableDataset | None  # what TRL prepares; None when the run trains on `block_stream`
    block_stream: RankLocalBlockStream | None  # this rank's packed blocks (`pack_blocks: true`)
    collator: Callable | None  # the one that goes with the blocks; None: TRL's own
    report: DataReport | MixtureReport
    sample_prompts: list[Prompt]  # answered before and after training (samples.md); [] = none
    # With a block stream: takes its counts summed over ranks after every step, refuses too many drops
    count_stream: Callable | None = None
    # A stream read unpacked (TRL's pipeline): its rows and drops summed over ranks after every step, limit enforced
    stream_reads: StreamedRowDropsCallback | None = None
    eval: Dataset | VisionEvalBlocks | None = None  # held-out or eval_datasets rows: tokenized, or packed into blocks
    # Packed data whose passes were counted before training (every pass's steps known); None: not packed, or a
    # stream read once (max_steps)
    passes: PackedPasses | None = None

    @property
    def counted_while_training(self) -> bool:
        """Whether some drops are only known once training reads the rows (the report is written again at the end)."""
        return self.count_stream is not None or self.stream_reads is not None


def source_data(run: Run, tokenizer) -> SourceData:
    """The recipe's sources read as this run tokenizes (conversations left for the block stream when it packs)."""
    training = run.recipe.training
    return build_source_data(run.recipe.data, run.tokenization, tokenizer, training.seed,
                             training.max_length if run.packs_blocks else None)


def build_data(run: Run, tokenizer) -> RunData:
    """Read the rows (bad ones dropped and counted), turn them into tokens + labels through their format,
    and refuse to train when too many were dropped or nothing is left to learn."""
    data_args, training = run.recipe.data, run.recipe.training
    block_stream, collator, count_stream, stream_reads = None, None, None, None
    with prepared_once_per_cache():  # once per datasets cache (shared or node-local), not per rank
        sources = source_data(run, tokenizer)
    report = sources.report
    processing = vision_processing(run, tokenizer) if run.has_images else None
    eval_data = sources.eval
    if run.packs_blocks and run.has_images:  # whole examples with their pixels and own mRoPE positions
        block_stream = VisionBlockStream(
            sources.train, processing, training.max_length, *run.data_reader,
            template_kwargs=run.tokenization.template_kwargs, packing_window=data_args.packing_window,
            num_sources=len(report.sources), seed=training.seed,
        )
        collator = collate_blocks(VisionBlockCollator(training.max_length, tokenizer.pad_token_id))
        count_stream = partial(report.count_stream, max_dropped_share=data_args.max_dropped_share)
        if eval_data is not None:  # packed like the training blocks, pixels made as each block is read
            eval_data = VisionEvalBlocks(eval_data, processing, training.max_length, run.tokenization.template_kwargs)
    elif run.packs_blocks:  # each rank (x dataloader worker) reads and tokenizes its own shard
        block_stream = RankLocalBlockStream(
            sources.train, tokenizer, training.max_length, *run.data_reader,
            split_examples=data_args.split_examples, template_kwargs=run.tokenization.template_kwargs,
            packing_window=data_args.packing_window, num_sources=len(report.sources), seed=training.seed,
        )
        collator = collate_blocks(BlockDiagonalCollator(training.max_length, tokenizer.pad_token_id,
                                                        block_per_row=True))
        # What the readers drop, and each source's tokens, summed over ranks after every step
        count_stream = partial(report.count_stream, max_dropped_share=data_args.max_dropped_share)
    elif report.streamed:  # tokenized as TRL's dataloader reads it, in the training process
        stream_reads = StreamedRowDropsCallback([source.checked for source in report.sources],
                                                data_args.max_dropped_share)
    eval_left_out = sources.eval_left_out
    if isinstance(eval_data, VisionEvalBlocks):  # counted as it was planned: its pixels are made as it is read
        eval_counts, eval_left_out = (eval_data.tokens, eval_data.supervised), eval_data.left_out
    else:
        eval_counts = token_counts(eval_data) if eval_data is not None else (0, 0)
    if run.is_main:
        print(report.format(), flush=True)
        print(describe_eval(eval_data, eval_counts, eval_left_out, training.max_length, sources.eval_dropped),
              flush=True)
    report.enforce(data_args.max_dropped_share)
    refuse_eval_without_answers(eval_data, eval_counts[1], eval_left_out, training.max_length)
    passes = None
    if block_stream is not None and (not report.streamed or training.max_steps < 0):  # finite, or asked for passes
        passes = plan_passes(block_stream, training.per_device_train_batch_size, training.gradient_accumulation_steps,
                             training.dataloader_num_workers, training.max_steps, training.num_train_epochs,
                             training.ddp_timeout)
        if run.is_main:
            print(passes.describe(), flush=True)
    # Image prompts rendered now, as the run renders its rows (their images read at start: a bad path stops here)
    sample_prompts = prepared_prompts(sample_prompts_for_run(training, sources.raw_train, sources.raw_eval),
                                      processing, run.tokenization.template_kwargs)
    return RunData(train=None if run.packs_blocks else sources.train, block_stream=block_stream, collator=collator,
                   report=report, sample_prompts=sample_prompts, count_stream=count_stream,
                   stream_reads=stream_reads, eval=eval_data, passes=passes)


def vision_processing(run: Run, tokenizer) -> VisionProcessing:
    """The model's tokenizer and image processor (its preprocessor_config.json), bounded by min/max_pixels."""
    data_args = run.recipe.data
    return VisionProcessing(tokenizer, run.source.load_image_processor(), run.source.config,
                            min_pixels=data_args.min_pixels, max_pixels=data_args.max_pixels)


def audit_data(run: Run, tokenizer, n: int) -> str:
    """`--audit-data N`: N conversations with their supervised spans marked, and the mask statistics."""
    if not run.data_format.chat:
        raise RecipeError(
            f"--audit-data shows chat assistant masks, and {run.recipe.source} has dataset_format: "
            f"{run.data_format.name} ({where_set(run.recipe, 'dataset_format')}); use it with a chat recipe "
            f"(dataset_format one of {list(CHAT_FORMATS)})."
        )
    if run.recipe.data.datasets:
        raise RecipeError("--audit-data reads one dataset: audit each chat source of the mixture with "
                          "--datasets null --dataset_name PATH --dataset_format FORMAT.")
    read, checked = load_checked_dataset(run.recipe.data)
    rows = run.data_format.rows_to_train(read, run.recipe.data.train_turns)  # alpaca_chat: as conversations
    tokenization = run.tokenization
    run.data_format.check_tools_render(rows, tokenizer, tokenization)
    audited = audit_dataset(rows, tokenizer, n, max_length=tokenization.max_length, **tokenization.template_kwargs)
    # The rows dropped as they were read never reach the audit's conversations: said first, as a run says them
    return checked.format() + "\n" + format_report(audited)
