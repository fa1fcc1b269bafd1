"""The decisions a run makes once, from the recipe and the launcher, before anything heavy loads."""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from functools import cached_property

from sft_recipes.batching import derive_gradient_accumulation
from sft_recipes.compile import take_over_torch_compile
from sft_recipes.config import Recipe
from sft_recipes.data.formats import FORMATS, DatasetFormat, Tokenization
from sft_recipes.data.mixture import has_images
from sft_recipes.distributed import enable_cpu_fsdp, launched_world_size
from sft_recipes.fault.collective_timeout import bound_collective_waits
from sft_recipes.fault.output_disk import refuse_unwritable_output_dir
from sft_recipes.fault.resume import nothing_left_to_train, protect_output_dir, resolve_resume_checkpoint
from sft_recipes.hsdp import launched_mesh
from sft_recipes.lint import LintContext, lint_recipe
from sft_recipes.loading import ModelSource
from sft_recipes.reporting.console import keep_train_log, one_voice, open_train_log
from sft_recipes.reporting.hub import HubPush, take_over_hub_push
from sft_recipes.reporting.tracking import check_injected_mlflow_run, refuse_a_tracking_server_that_does_not_answer
from sft_recipes.run.sequence_parallel import SequenceParallel, start_sequence_parallel

logger = logging.getLogger("sft")


@dataclass
class Run:
    """One run's recipe and the decisions derived from it; every later step reads them from here."""

    recipe: Recipe
    source: ModelSource  # the model's config, read once at its revision, and where its files are
    batch_derivation: str  # how gradient accumulation follows from the global batch, every factor shown
    resume_from: str | None = None  # the checkpoint this run continues, chosen (and checked) before anything loads
    hub_push: HubPush | None = None  # `push_to_hub`: ours, after the export check (the Trainer's is switched off)
    sequence_parallel: SequenceParallel | None = None  # this rank's group; None: every rank has its own blocks
    finished: str | None = None  # why there is nothing to train: the checkpoint resumed from is at max_steps
    compiles_layers: bool = False  # `torch_compile`: each decoder layer compiled before FSDP2 wraps it (not by accelerate)

    @property
    def data_reader(self) -> tuple[int, int]:
        """(this rank's data reader, number of readers): the ranks of a sequence-parallel group share one."""
        if self.sequence_parallel is not None:
            return self.sequence_parallel.layout.dp_rank, self.sequence_parallel.layout.dp_size
        return self.recipe.training.process_index, self.recipe.training.world_size

    @property
    def is_main(self) -> bool:
        return self.recipe.training.process_index == 0

    @property
    def packs_blocks(self) -> bool:
        """Conversations stream per rank into block-diagonal blocks (`pack_blocks`), instead of TRL's dataset."""
        return self.recipe.data.pack_blocks

    @cached_property
    def has_images(self) -> bool:
        """An image source in the recipe: image blocks, the image preflight, the vision tower per the recipe."""
        return has_images(self.recipe.data)

    @cached_property
    def data_format(self) -> DatasetFormat:
        return FORMATS[self.recipe.data.dataset_format]

    @cached_property
    def tokenization(self) -> Tokenization:
        data, training = self.recipe.data, self.recipe.training
        return Tokenization(
            max_length=None if self.packs_blocks else training.max_length,  # packing splits long rows, never cuts
            overlong_policy=data.overlong_policy,
            completion_only_loss=training.completion_only_loss,
            template_kwargs=dict(data.chat_template_kwargs or {}),
        )


def start_run(recipe: Recipe, read_only: bool = False) -> Run:
    """Lint against the launcher and the model's config, derive the global batch, make FSDP2 real on
    CPU too, bound every collective wait, keep output_dir to one recipe, choose the checkpoint to resume
    from (a run already at max_steps is `finished`: nothing loads), and have the model's files ready.

    `read_only` (`--audit-data`): output_dir is neither tidied nor resumed from, so an audit reads the data
    the same way before, during and after a run, whatever the checkpoints there were trained on."""
    one_voice()  # one set of progress bars and kernel fall-back lines, rank 0's
    if not read_only:
        open_train_log(recipe.training.output_dir)  # output_dir/train.log: rank 0's console, every rank's refusal
    source = ModelSource(recipe.model)
    lint_recipe(recipe, LintContext.from_environment(lambda: source.config))
    refuse_a_tracking_server_that_does_not_answer(recipe.training, recipe.model.mlflow_experiment_name)
    check_injected_mlflow_run(recipe.training, recipe.model.mlflow_experiment_name,  # a run MLflow would refuse late
                              is_main=os.environ.get("RANK", "0") == "0")
    training = recipe.training
    hub_push = take_over_hub_push(training)  # before the Trainer exists; a missing id or token refused now
    compiles_layers = take_over_torch_compile(training)  # before the Trainer exists: accelerate compiles nothing itself
    training.gradient_accumulation_steps, derivation = derive_gradient_accumulation(training, launched_world_size())
    enable_cpu_fsdp()  # before the Trainer creates its Accelerator: FSDP2 on CPU too
    bound_collective_waits(training)  # a dead or hung rank fails the others within ddp_timeout
    resume_from = None
    if not read_only:
        refuse_unwritable_output_dir(training.output_dir)  # before any data or model work
        protect_output_dir(recipe, training)  # never mix two recipes' checkpoints
        resume_from = resolve_resume_checkpoint(training)  # refuses a layout the checkpoint cannot continue on
        finished = nothing_left_to_train(resume_from, training)
        if finished:
            if training.process_index == 0:
                print(finished, flush=True)
            return Run(recipe=recipe, source=source, batch_derivation=derivation, resume_from=resume_from,
                       finished=finished)
    if not read_only:
        keep_train_log()  # this run trains: its console from the start into train.log
    with training.main_process_first(local=False, desc="model files"):
        source.ensure_files()  # a tiny stand-in is built once, by the main process
    if source.cache_only:  # peft asks the Hub for the base's config.json at each adapter save, unless this is set
        os.environ["HF_HUB_OFFLINE"] = "1"
        # ... and then warns, each save on each rank, that it assumes the vocabulary unchanged: a run never resizes it.
        warnings.filterwarnings("ignore", "Could not find a config file in .* will assume that the vocabulary was not "
                                "modified", UserWarning)
    run = Run(recipe=recipe, source=source, batch_derivation=derivation, resume_from=resume_from, hub_push=hub_push,
              sequence_parallel=start_sequence_parallel(recipe),  # the process group exists by now
              compiles_layers=compiles_layers)
    if run.is_main:
        logger.info("recipe %s -> output_dir %s; %s; %s", recipe.source, training.output_dir, derivation,
                    launched_mesh(training.world_size).describe())
        if source.cache_only:
            logger.info("model %s: its files from the Hugging Face cache only (%s)", recipe.model.model_name_or_path,
                        source.cache_only)
        for origin, values in recipe.overrides.items():  # which keys the workload's parameters / the caller set
            logger.info("overrides from %s: %s", origin, ", ".join(f"{key}={value!r}" for key, value in values.items()))
    return run
