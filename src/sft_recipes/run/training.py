"""The trainer of a run, with every callback wired inside, and the training itself (resume, timing)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from sft_recipes.distributed import set_fsdp_reduce_dtype, verify_distributed
from sft_recipes.evaluation import evaluated_at_last_step
from sft_recipes.fault import fault_tolerance_callbacks
from sft_recipes.fault.resume import recipe_identity, resolve_resume_checkpoint
from sft_recipes.metrics import ThroughputMeter
from sft_recipes.reporting.summary import RunSummaryCallback
from sft_recipes.reporting.tracking import DataReportCallback, RecipeParamsCallback, configure_mlflow
from sft_recipes.run.data import RunData
from sft_recipes.run.model import RunModel
from sft_recipes.run.setup import Run
from sft_recipes.trainer import RecipeSFTTrainer

logger = logging.getLogger("sft")


@dataclass
class Training:
    trainer: RecipeSFTTrainer
    summary: RunSummaryCallback
    layout: str  # what really runs, e.g. "FSDP2 over 2 process(es) on cpu"
    resumed_from: str | None = None
    seconds: float = 0.0

    def run(self) -> None:
        """Train, resuming as the recipe's `resume_from_checkpoint` says (see `fault.resume`); with eval data,
        end on an eval loss of the final weights (unless the last step was just evaluated, or eval_strategy is no)."""
        self.resumed_from = resolve_resume_checkpoint(self.trainer.args)
        start = time.perf_counter()
        self.trainer.train(resume_from_checkpoint=self.resumed_from)
        self.seconds = time.perf_counter() - start
        if self.trainer.eval_dataset is not None and not evaluated_at_last_step(self.trainer.state):
            self.trainer.evaluate()


def build_trainer(run: Run, data: RunData, built: RunModel, tokenizer) -> Training:
    recipe, training_args = run.recipe, run.recipe.training
    summary = RunSummaryCallback(configure_mlflow(training_args, recipe.model.mlflow_experiment_name))
    throughput = ThroughputMeter.for_run(run.source.config, built.lora_config, training_args.device)
    trainer = RecipeSFTTrainer(
        model=built.model,
        args=training_args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        block_stream=data.block_stream,
        data_collator=data.collator,
        processing_class=tokenizer,
        throughput=throughput,  # tokens/s per device, MFU, peak memory in every log
        adapter_checkpoints=built.lora_config is not None,  # checkpoints in PEFT format too
        callbacks=[RecipeParamsCallback(recipe.values), summary, DataReportCallback(data.report),
                   *fault_tolerance_callbacks(training_args, recipe_identity(recipe))],
    )
    layout = verify_distributed(trainer)
    set_fsdp_reduce_dtype(trainer, training_args.fsdp_reduce_dtype)
    if run.is_main:
        logger.info("distributed: %s; throughput: %s", layout, throughput.describe())
    return Training(trainer=trainer, summary=summary, layout=layout)
