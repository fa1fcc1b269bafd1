"""SFTTrainer plus what it lacks: packed streams (a rank-local dataloader and its stop signal), sequence
parallelism over their blocks, live throughput in every log, a token-weighted eval loss, and LoRA checkpoints
loadable as PEFT adapters."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import datasets
import torch
from torch.utils.data import DataLoader
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import SFTTrainer

from sft_recipes.architectures.sequence_parallel import SequenceParallelLayout
from sft_recipes.data.blocks import IGNORE_INDEX, RankLocalBlockStream, StopWhenAnyRankExhausted, StreamStats
from sft_recipes.data.sequence_shards import shard_block
from sft_recipes.distributed import replicas_reduced_at_the_step_end
from sft_recipes.evaluation import TokenWeightedEvalMixin
from sft_recipes.export import export_adapter
from sft_recipes.fault.output_disk import check_room_before_save, saved_or_refused
from sft_recipes.fault.uneven_shards import EndOfDataTogetherMixin
from sft_recipes.fault.world_size import whole_global_batches
from sft_recipes.metrics import ThroughputMeter, real_tokens_and_attention_length
from sft_recipes.reporting.data_wait import DataWaitMixin

logger = logging.getLogger(__name__)


class BlockLoader(DataLoader):
    """A block stream's loader: as long as a counted pass (`stream.micro_batches_per_pass`), else of no length (the
    Trainer then runs to max_steps, or until the stream ends)."""

    def __len__(self) -> int:
        if self.dataset.micro_batches_per_pass is None:
            raise TypeError("a packed stream read once has no length")
        return self.dataset.micro_batches_per_pass


class RecipeSFTTrainer(DataWaitMixin, TokenWeightedEvalMixin, EndOfDataTogetherMixin, SFTTrainer):
    """SFTTrainer that can also train on a `RankLocalBlockStream`, ends every pass over per-rank
    streamed shards on the same step on every rank (`EndOfDataTogetherMixin`), and reports eval loss
    as the token-weighted mean over every rank (`TokenWeightedEvalMixin`), and times its waits for data
    (`DataWaitMixin`: the closing line's s/step leaves them out otherwise).

    The stream is already sharded per rank, so accelerate must not shard it again (it would make
    every rank read, and tokenize, the whole stream): `get_train_dataloader` serves it directly.
    TRL only accepts `datasets` types, so it is handed a one-block stand-in with dataset
    preparation skipped (the stream is tokenized and packed already).

    With `adapter_checkpoints`, every checkpoint also holds the LoRA adapter in PEFT format
    (`checkpoint-N/adapter/`): FSDP2 checkpoints keep it only as DCP shards (for resume). It is
    written inside the save, so the completion marker (an `on_save` callback) comes after it.

    With `sequence_parallel` (the rank's `SequenceParallelLayout`), the ranks of a group read the
    same blocks and each trains on its chunk (`shard_block`, labels shifted on the whole block).
    TRL's loss then needs nothing else: its fused LM head scores the chunk's pre-shifted
    `shift_labels` (logits for those positions only, in tiles), divides the summed token loss by
    the step's supervised-token count (`num_items_in_batch`, always counted here, over every
    rank's whole blocks divided by the N copies of each; transformers counts it only for models
    that take loss kwargs, not e.g. Qwen3.5's VLM class) and multiplies it by the world size,
    which FSDP2's gradient average divides back out: the gradient of the mean over the global
    batch's supervised tokens, with no further division by the accumulation steps. The logged
    loss (mean over ranks) is that mean.
    """

    def __init__(self, *args, block_stream: RankLocalBlockStream | None = None,
                 count_stream: Callable[[StreamStats, bool], None] | None = None,
                 throughput: ThroughputMeter | None = None, adapter_checkpoints: bool = False,
                 sequence_parallel: SequenceParallelLayout | None = None, **kwargs):
        self.throughput = throughput
        self.block_stream = block_stream
        self.adapter_checkpoints = adapter_checkpoints
        self.sequence_parallel = sequence_parallel
        if sequence_parallel is not None:
            self.loss_is_scaled_for_ga = True  # by num_items_in_batch, which covers the accumulation steps
        self.exhaustion = None
        self.stream_stats = StreamStats()  # what this rank trained on from the block stream
        if self.block_stream is not None:
            training_args = kwargs["args"]
            training_args.dataset_kwargs = {**(training_args.dataset_kwargs or {}), "skip_prepare_dataset": True}
            kwargs["train_dataset"] = datasets.Dataset.from_list([self.block_stream.exhausted_block()])
        super().__init__(*args, **kwargs)
        # TRL's compute_loss sums the token losses and divides by `num_items_in_batch` itself; the model's forward
        # never sees it. The Trainer counts it over every rank and accumulation step only for models that "accept
        # loss kwargs", and VLM classes (Qwen3_5ForConditionalGeneration) say no for their own forward's sake, which
        # made a step's loss the mean of per-rank, per-micro-batch means. Every step is the global token mean.
        self.model_accepts_loss_kwargs = True
        if self.block_stream is not None:
            self.exhaustion = StopWhenAnyRankExhausted(self.stream_stats, count_stream, self.block_stream.num_sources,
                                                       passes_counted=self.block_stream.micro_batches_per_pass is not None)
            self.add_callback(self.exhaustion)

    @property
    def training_data(self):
        """What the model is really trained on: the block stream, or TRL's prepared dataset."""
        return self.block_stream if self.block_stream is not None else self.train_dataset

    def _get_train_sampler(self, train_dataset=None):
        # Every step a whole global batch of one world-size-independent permutation (see fault.world_size).
        return whole_global_batches(super()._get_train_sampler(train_dataset), self.args)

    def get_train_dataloader(self) -> DataLoader:
        if self.block_stream is None:
            return super().get_train_dataloader()
        workers = self.args.dataloader_num_workers
        return BlockLoader(
            self.block_stream,
            batch_size=self._train_batch_size,
            collate_fn=self.data_collator,
            num_workers=workers,  # each worker reads and tokenizes its own shard of this rank's
            prefetch_factor=self.args.dataloader_prefetch_factor if workers else None,
            persistent_workers=False,  # workers take the stream's pass when they start: new ones each pass
            pin_memory=self.args.dataloader_pin_memory,
        )

    def _run_epoch(self, *args, epoch, **kwargs):
        if self.block_stream is not None:  # before the pass's iterator starts (and its workers copy the stream)
            self.block_stream.epoch = epoch
        return super()._run_epoch(*args, epoch=epoch, **kwargs)

    def set_initial_training_values(self, args, dataloader):
        if self.sequence_parallel is None or self.block_stream is None:
            return super().set_initial_training_values(args, dataloader)
        # transformers multiplies a loader's length by the SP size (its own SP adapter splits each batch over the
        # group); here every rank of a group reads the group's whole blocks, and the loader counts them already.
        layout, self.sequence_parallel = self.sequence_parallel, None
        try:
            return super().set_initial_training_values(args, dataloader)
        finally:
            self.sequence_parallel = layout

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log (not the end-of-training summary)
            if self.throughput is not None:
                logs.update(self.throughput.report())
            if self.block_stream is not None:  # this rank's running share of real tokens in its blocks
                logs["packing_efficiency"] = round(self.stream_stats.packing_efficiency, 4)
            if self.args.include_num_input_tokens_seen != "no" and self._metrics["train"].get("num_tokens"):
                # TRL 1.16 counts a batch without attention_mask as position_ids.size(1): a block's length once
                # for a batch of B blocks, the batch size for [4, B, T] mRoPE positions, and from 0 again after
                # a resume. The real tokens seen, counted once (_track_num_input_tokens, saved in checkpoints):
                self._metrics["train"]["num_tokens"] = [self.state.num_input_tokens_seen]
        super().log(logs, start_time)

    def train(self, *args, **kwargs):
        if self.throughput is not None:
            self.throughput.restart()  # model loading and preparation are not training time
        if self.sequence_parallel is not None:
            layout, block = self.sequence_parallel, self.args.max_length
            chunk = block // layout.sp_size
            logger.info("[sequence parallel] rank %d holds tokens %d-%d of each %d-token block of reader %d of %d",
                        self.args.process_index, layout.sp_rank * chunk, (layout.sp_rank + 1) * chunk - 1, block,
                        layout.dp_rank, layout.dp_size)
        result = super().train(*args, **kwargs)
        if self.block_stream is not None:  # each rank trained on its own shard
            logger.info("[data] rank %d trained on %s", self.args.process_index, self.stream_stats.describe())
            if self.args.process_index == 0:
                logger.info("[data] all %d ranks trained on %s", self.args.world_size, self.exhaustion.total.describe())
        return result

    def _track_num_input_tokens(self, inputs):
        """`state.num_input_tokens_seen` as the throughput counts tokens: a block stream's exact real tokens (its
        padding tails left out), else the batch's unpadded tokens; a sequence-parallel group's block once (its ranks
        all hold it whole here). transformers' own count takes every rank's input_ids, padding included."""
        if self.args.include_num_input_tokens_seen == "no":
            return
        stats = inputs.get("stream_stats")
        tokens = stats.real_tokens if stats is not None else real_tokens_and_attention_length(inputs)[0]
        if self.sequence_parallel is not None and self.sequence_parallel.sp_rank != 0:
            tokens = 0
        counted = torch.tensor(tokens, device=self.args.device, dtype=torch.int64)
        self.state.num_input_tokens_seen += int(self.accelerator.gather(counted).sum().item())

    def training_step(self, model, inputs, num_items_in_batch=None):
        exhausted = inputs.pop("stream_exhausted", None)
        stats = inputs.pop("stream_stats", None)
        if stats is not None:
            self.stream_stats.add(stats)
        if self.throughput is not None:  # a block stream knows its real tokens exactly, without the padding tails
            if stats is not None:
                self.throughput.count(stats.real_tokens, stats.squared_segment_lengths)
            else:
                self.throughput.observe(inputs)
        if exhausted is not None and bool(exhausted):
            self.exhaustion.exhausted = True
        if self.sequence_parallel is not None:
            inputs = shard_block(inputs, self.sequence_parallel.sp_rank, self.sequence_parallel.sp_size)
        with replicas_reduced_at_the_step_end(model, self.accelerator.sync_gradients):
            return super().training_step(model, inputs, num_items_in_batch)

    def get_sp_size(self) -> int:
        """Ranks holding the same sequences: transformers divides them out of the global batch size."""
        return self.sequence_parallel.sp_size if self.sequence_parallel is not None else super().get_sp_size()

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        if self.sequence_parallel is None:
            return super()._get_num_items_in_batch(batch_samples, device)
        # Next-token targets of the whole blocks (labels[1:] is what shift_labels keeps), over every rank.
        local = sum(int((batch["labels"][..., 1:] != IGNORE_INDEX).sum()) for batch in batch_samples)
        every_rank = self.accelerator.gather(torch.tensor(local, device=device)).sum()
        return every_rank / self.sequence_parallel.sp_size  # each block was counted by each rank of its group

    def _save_checkpoint(self, model, trial):
        checkpoint = Path(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        # A disk without room for it is refused before the save, one that fills during it in one line, on every rank.
        check_room_before_save(self.args.output_dir, self.state.global_step, self.args.ddp_timeout)
        save = super()._save_checkpoint  # bound here: the name RecipeSFTTrainer may name a subclass by save time
        saved_or_refused(lambda: save(model, trial), checkpoint, self.args.ddp_timeout)
        if self.adapter_checkpoints:  # collective, like the save itself
            export_adapter(self, checkpoint / "adapter")
