"""SFTTrainer plus what it lacks: packed streams (a rank-local dataloader and its stop signal), live
throughput in every log, a token-weighted eval loss, and LoRA checkpoints loadable as PEFT adapters."""

from __future__ import annotations

import logging
from pathlib import Path

import datasets
from torch.utils.data import DataLoader
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import SFTTrainer

from sft_recipes.data.blocks import RankLocalBlockStream, StopWhenAnyRankExhausted, StreamStats
from sft_recipes.evaluation import TokenWeightedEvalMixin
from sft_recipes.export import export_adapter
from sft_recipes.fault.uneven_shards import EndOfDataTogetherMixin
from sft_recipes.metrics import ThroughputMeter

logger = logging.getLogger(__name__)


class RecipeSFTTrainer(TokenWeightedEvalMixin, EndOfDataTogetherMixin, SFTTrainer):
    """SFTTrainer that can also train on a `RankLocalBlockStream`, ends every pass over per-rank
    streamed shards on the same step on every rank (`EndOfDataTogetherMixin`), and reports eval loss
    as the token-weighted mean over every rank (`TokenWeightedEvalMixin`).

    The stream is already sharded per rank, so accelerate must not shard it again (it would make
    every rank read, and tokenize, the whole stream): `get_train_dataloader` serves it directly.
    TRL only accepts `datasets` types, so it is handed a one-block stand-in with dataset
    preparation skipped (the stream is tokenized and packed already).

    With `adapter_checkpoints`, every checkpoint also holds the LoRA adapter in PEFT format
    (`checkpoint-N/adapter/`): FSDP2 checkpoints keep it only as DCP shards (for resume). It is
    written inside the save, so the completion marker (an `on_save` callback) comes after it.
    """

    def __init__(self, *args, block_stream: RankLocalBlockStream | None = None,
                 throughput: ThroughputMeter | None = None, adapter_checkpoints: bool = False, **kwargs):
        self.throughput = throughput
        self.block_stream = block_stream
        self.adapter_checkpoints = adapter_checkpoints
        self.exhaustion = None
        self.stream_stats = StreamStats()  # what this rank trained on from the block stream
        if self.block_stream is not None:
            training_args = kwargs["args"]
            training_args.dataset_kwargs = {**(training_args.dataset_kwargs or {}), "skip_prepare_dataset": True}
            kwargs["train_dataset"] = datasets.Dataset.from_list([self.block_stream.exhausted_block()])
        super().__init__(*args, **kwargs)
        if self.block_stream is not None:
            self.exhaustion = StopWhenAnyRankExhausted(self.stream_stats)
            self.add_callback(self.exhaustion)

    @property
    def training_data(self):
        """What the model is really trained on: the block stream, or TRL's prepared dataset."""
        return self.block_stream if self.block_stream is not None else self.train_dataset

    def get_train_dataloader(self) -> DataLoader:
        if self.block_stream is None:
            return super().get_train_dataloader()
        workers = self.args.dataloader_num_workers
        return DataLoader(
            self.block_stream,
            batch_size=self._train_batch_size,
            collate_fn=self.data_collator,
            num_workers=workers,  # each worker reads and tokenizes its own shard of this rank's
            prefetch_factor=self.args.dataloader_prefetch_factor if workers else None,
            persistent_workers=self.args.dataloader_persistent_workers if workers else False,
            pin_memory=self.args.dataloader_pin_memory,
        )

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log (not the end-of-training summary)
            if self.throughput is not None:
                logs.update(self.throughput.report())
            if self.block_stream is not None:  # this rank's running share of real tokens in its blocks
                logs["packing_efficiency"] = round(self.stream_stats.packing_efficiency, 4)
        super().log(logs, start_time)

    def train(self, *args, **kwargs):
        if self.throughput is not None:
            self.throughput.restart()  # model loading and preparation are not training time
        result = super().train(*args, **kwargs)
        if self.block_stream is not None:  # each rank trained on its own shard
            logger.info("[data] rank %d trained on %s", self.args.process_index, self.stream_stats.describe())
        return result

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
        return super().training_step(model, inputs, num_items_in_batch)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.adapter_checkpoints:  # collective, like the save itself
            checkpoint = Path(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            export_adapter(self, checkpoint / "adapter")
