"""Eval loss: the mean over every supervised token of the eval set, whatever the world size.

transformers 5.23's `evaluation_loop` averages per-batch mean losses (each repeated by its batch's
row count), so a batch of short answers weighs as much as one of long answers, and accelerate's
even batches evaluate some rows twice on the last step. Here each rank evaluates its own rows
(every `world_size`-th, so none twice), sums the supervised tokens' losses and counts them per batch,
and one all-reduce (`token_loss.global_sum`, as the training loss's global token mean) gives the
token-weighted mean. Every rank runs the same number of forwards (FSDP2 gathers parameters in
each): a rank with fewer rows repeats a batch without counting it. The loss comes from TRL's fused
LM head, as in training (`fused_lm_head=True`: per-token log-probabilities of the next-token labels,
projected in tiles, never the full `[tokens, vocab]` logits that made eval the peak of a long-block
run), summed over the supervised tokens, so a packed block-diagonal batch and the same examples
unpadded give the same sum; a mixture of experts' balancing loss is not part of it. Under sequence
parallelism each rank evaluates its own rows whole (`sequence_parallel_suspended`): no gradients
are kept, so a whole block's activations are one layer's at a time.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader
from transformers.trainer_utils import EvalLoopOutput

from sft_recipes.architectures.sequence_parallel import sequence_parallel_suspended
from sft_recipes.errors import RecipeError
from sft_recipes.token_loss import global_sum

# Popped from packed batches before the forward: they are the training stream's bookkeeping.
STREAM_KEYS = ("stream_exhausted", "stream_stats")


class RankEvalBatches:
    """This rank's eval rows (every `world`-th, from `rank`) in batches, as (batch, counted) pairs.

    Every rank yields the same number of pairs; past its own rows a rank repeats its last batch (its
    first row, when it has none) with `counted=False`.
    """

    def __init__(self, dataset, rank: int, world: int, batch_size: int, collate) -> None:
        self.rows = len(dataset)
        self.steps = math.ceil(math.ceil(self.rows / world) / batch_size)
        own = dataset.select(range(rank, self.rows, world)) if rank < self.rows else dataset.select([0])
        self.loader = DataLoader(own, batch_size=batch_size, collate_fn=collate)
        self.has_rows = rank < self.rows

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        batches = iter(self.loader)
        batch = None
        for _ in range(self.steps):
            fresh = next(batches, None) if self.has_rows else None
            batch = fresh if fresh is not None else (batch if batch is not None else next(iter(self.loader)))
            yield batch, fresh is not None


class TokenWeightedEvalMixin:
    """Trainer mixin: `evaluate()` reports `eval_loss` as the global token-weighted mean (and `eval_tokens`)."""

    def get_eval_dataloader(self, eval_dataset=None) -> RankEvalBatches:
        if eval_dataset is None or isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset if eval_dataset is None else self.eval_dataset[eval_dataset]
        if eval_dataset is None or len(eval_dataset) == 0:
            raise RecipeError("Evaluation needs eval data: set test_split_size or eval_datasets in the recipe.")
        return RankEvalBatches(eval_dataset, self.args.process_index, self.args.world_size, self.args.eval_batch_size,
                               self.data_collator)

    def evaluation_loop(self, dataloader: RankEvalBatches, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval") -> EvalLoopOutput:
        model = self.model
        model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.args.device)  # summed token loss, supervised tokens
        for batch, counted in dataloader:
            inputs = self._prepare_inputs({key: value for key, value in batch.items() if key not in STREAM_KEYS})
            with torch.no_grad(), self.compute_loss_context_manager(), sequence_parallel_suspended():
                outputs = model(**inputs, use_cache=False, fused_lm_head=True)
            if counted:  # log-probabilities are zero where the label is ignored
                totals += torch.stack([-outputs.log_probs.double().sum(), outputs.label_mask.double().sum()])
        loss_sum, tokens = global_sum(totals).tolist()
        metrics = {f"{metric_key_prefix}_loss": loss_sum / tokens if tokens else float("nan"),
                   f"{metric_key_prefix}_tokens": int(tokens)}
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=dataloader.rows)


def evaluated_at_last_step(state) -> bool:
    """Whether the newest eval loss in the (every-rank) log history is of the current step."""
    return any("eval_loss" in entry and entry.get("step") == state.global_step for entry in state.log_history)
