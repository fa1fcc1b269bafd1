"""The trainer of a run, with every callback wired inside, and the training itself (resume, timing)."""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field

from sft_recipes.compile import CompileReport
from sft_recipes.data.blocks import data_ended_line
from sft_recipes.distributed import reduce_scatter_every_micro_batch, set_fsdp_reduce_dtype, verify_distributed
from sft_recipes.evaluation import evaluated_at_last_step
from sft_recipes.fault import fault_tolerance_callbacks
from sft_recipes.fault.resume import recipe_identity
from sft_recipes.fault.world_size import log_world_size_change
from sft_recipes.hsdp import MeshCheck, launched_mesh
from sft_recipes.metrics import ThroughputMeter
from sft_recipes.precision import PrecisionCheck, expected_precision
from sft_recipes.reporting.console import use_step_lines
from sft_recipes.reporting.curves import TrainingCurvesCallback
from sft_recipes.reporting.samples import (
    BaseSamplesCallback, Prompt, answers_in_lockstep, sample_settings, write_base_samples,
)
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
    sample_prompts: list[Prompt] = field(default_factory=list)  # answered again by the export at the finish

    def run(self) -> None:
        """Train, from `resumed_from` when the run continues a checkpoint (chosen by `start_run`); with eval data,
        end on an eval loss of the final weights (unless the last step was just evaluated; eval_strategy: no too)."""
        if self.resumed_from:
            self.summary.world_size_at_checkpoint = log_world_size_change(self.resumed_from, self.trainer.args)
        start = time.perf_counter()
        self.trainer.train(resume_from_checkpoint=self.resumed_from)
        self.seconds = time.perf_counter() - start
        exhaustion, state = self.trainer.exhaustion, self.trainer.state
        if exhaustion is not None and exhaustion.data_ended_at_step is not None and \
                exhaustion.data_ended_at_step < state.max_steps:
            self.summary.data_ended = data_ended_line(exhaustion.data_ended_at_step, state.max_steps)
        if self.trainer.eval_dataset is not None and not evaluated_at_last_step(self.trainer.state):
            self.trainer.evaluate()


def build_trainer(run: Run, data: RunData, built: RunModel, tokenizer) -> Training:
    recipe, training_args = run.recipe, run.recipe.training
    summary = RunSummaryCallback(configure_mlflow(training_args, recipe.model.mlflow_experiment_name),
                                 overrides=recipe.overrides)
    if data.passes is not None:
        summary.packed_passes = {"steps_per_pass": data.passes.steps_per_pass, "passes": data.passes.passes}
    throughput = ThroughputMeter.for_run(run.source.config, built.lora_config, training_args.device,
                                         training_args.sequence_parallel_size)
    reporting = [TrainingCurvesCallback()]  # training_curves.png at each save and at the end
    if data.sample_prompts and answers_in_lockstep(training_args):
        reporting.append(BaseSamplesCallback(data.sample_prompts, **sample_settings(recipe)))
    elif data.sample_prompts and run.is_main and run.sequence_parallel is None:  # the model is still whole here
        # On a copy: generating changes the model's state (its cache settings), and rank 0 alone generates, so the
        # ranks would train different models (seen on gpt-oss + LoRA: the export check failed by 0.70).
        model_copy = copy.deepcopy(built.model)
        model_copy._forward_pre_hooks.clear()  # the LoRA layout guard is the original's, checked at its first step
        model_copy._forward_pre_hooks_with_kwargs.clear()
        write_base_samples(training_args.output_dir, data.sample_prompts, model_copy, tokenizer,
                           **sample_settings(recipe))
    reduce_scatter_every_micro_batch(training_args)  # gradients stay sharded between micro-batches
    trainer = RecipeSFTTrainer(
        model=built.model,
        args=training_args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        block_stream=data.block_stream,
        count_stream=data.count_stream,  # drops summed over ranks, max_dropped_share enforced while training
        data_collator=data.collator,
        processing_class=tokenizer,
        throughput=throughput,  # tokens/s per device, MFU, peak memory in every log
        adapter_checkpoints=built.lora_config is not None,  # checkpoints in PEFT format too
        sequence_parallel=run.sequence_parallel.layout if run.sequence_parallel is not None else None,
        callbacks=[RecipeParamsCallback(recipe.values), summary,
                   *([data.stream_reads] if data.stream_reads is not None else []),  # before the report is written
                   DataReportCallback(data.report, counted_while_training=data.counted_while_training),
                   *fault_tolerance_callbacks(training_args, recipe_identity(recipe)), *reporting,
                   # before the step lines (added last): they show its count of compiled graphs
                   *([CompileReport(built.compiled_layers, built.wrap_classes)] if built.compiled_layers else [])],
    )
    use_step_lines(trainer)  # one compact console line per log, not transformers' dict
    layout = verify_distributed(trainer)
    if trainer.is_fsdp_enabled:  # the model is sharded in train(): checked, and its mesh logged, at its start
        trainer.add_callback(MeshCheck(launched_mesh(training_args.world_size)))
    set_fsdp_reduce_dtype(trainer, training_args.fsdp_reduce_dtype)
    if trainer.is_fsdp_enabled and (precision := expected_precision(training_args)) is not None:
        trainer.add_callback(PrecisionCheck(precision))  # the policy fully_shard got, checked and logged at its start
    if run.is_main:
        logger.info("distributed: %s; throughput: %s", layout, throughput.describe())
    return Training(trainer=trainer, summary=summary, layout=layout, resumed_from=run.resume_from,
                    sample_prompts=data.sample_prompts)
