#!/usr/bin/env python3
"""Supervised fine-tuning with TRL's SFTTrainer, driven by one recipe YAML.

    accelerate launch --config_file accelerate_configs/fsdp2_8gpu.yaml scripts/sft.py recipes/llama8b.yaml
    accelerate launch --config_file accelerate_configs/fsdp2_cpu.yaml scripts/sft.py recipes/tiny/llama8b.yaml \
        --max_steps 5 --output_dir outputs/try

Any recipe key can be overridden with `--key value`. The heavy lifting lives in `sft_recipes`;
this file is the table of contents of a run.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from sft_recipes.environment import set_runtime_defaults

set_runtime_defaults()  # before anything imports huggingface_hub or touches CUDA

from transformers import AutoConfig
from trl.trainer.utils import global_then_local_main_first

from sft_recipes.config import RecipeError, load_recipe
from sft_recipes.data.audit import audit_dataset, format_report
from sft_recipes.data.formats import CHAT_FORMATS, check_columns
from sft_recipes.data.validation import DataReportCallback, apply_length_policy, load_checked_dataset
from sft_recipes.data.prepare import prepare_train_dataset
from sft_recipes.dry_run import accelerate_config_for_plan, export_launch_environment, plan_recipe, planned_world_size
from sft_recipes.distributed import (
    enable_cpu_fsdp, launched_world_size, process_group_destroyed_on_exit, set_fsdp_reduce_dtype, verify_distributed,
)
from sft_recipes.fault import fault_tolerance_callbacks
from sft_recipes.fault.collective_timeout import bound_collective_waits
from sft_recipes.export import AdapterCheckpointCallback, export_run
from sft_recipes.fsdp_wrap import guard_lora_fsdp_layout, pin_fsdp_wrap_classes
from sft_recipes.batching import derive_gradient_accumulation
from sft_recipes.lint import LintContext, lint_recipe
from sft_recipes.lora import apply_lora, build_lora_config
from sft_recipes.metrics import ThroughputMeter
from sft_recipes.modeling import load_model, load_tokenizer, model_config_of, resolve_model_path
from sft_recipes.models import check_packing_leak, freeze_vision_tower, prepare_for_packing
from sft_recipes.plan import format_plan, load_model_config
from sft_recipes.runs import RunSummaryCallback, protect_output_dir, recipe_identity, resolve_resume_checkpoint
from sft_recipes.tracking import RecipeParamsCallback, configure_mlflow
from sft_recipes.trainer import RecipeSFTTrainer

logger = logging.getLogger("sft")


def parse_command_line(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/llama8b.yaml")
    parser.add_argument("--dry-run", action="store_true",
                        help="lint the recipe and print the plan (parameters, memory per GPU, fit, time); no GPU, no weights")
    parser.add_argument("--config_file", help="with --dry-run: the accelerate config the run will be launched with")
    parser.add_argument("--world_size", type=int, help="with --dry-run: number of processes (overrides --config_file)")
    parser.add_argument("--plan-json", help="with --dry-run: also write the plan as JSON to this path")
    parser.add_argument("--audit-data", type=int, metavar="N", default=0,
                        help="show N conversations with their supervised spans marked, report mask statistics, stop")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)

    # ── Parse ─────────────────────────────────────────────────────────────────────────────────
    cli, overrides = parse_command_line(sys.argv[1:] if argv is None else argv)
    if cli.dry_run:
        return dry_run(cli, overrides)
    try:
        recipe = load_recipe(cli.recipe, overrides)
        lint_recipe(recipe, LintContext.from_environment(lambda: model_config_of(recipe.model)))
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    data_args, model_args, training_args = recipe.data, recipe.model, recipe.training
    training_args.gradient_accumulation_steps, batch_derivation = derive_gradient_accumulation(
        training_args, launched_world_size()
    )
    enable_cpu_fsdp()  # before the Trainer creates its Accelerator: FSDP2 on CPU too
    is_main = training_args.process_index == 0
    if is_main:
        logger.info("recipe %s -> output_dir %s; %s", recipe.source, training_args.output_dir, batch_derivation)

    # ── Data ──────────────────────────────────────────────────────────────────────────────────
    bound_collective_waits(training_args)  # a dead or hung rank fails the others within ddp_timeout
    raw_dataset, data_report = load_checked_dataset(data_args)  # bad rows dropped and counted per reason
    check_columns(raw_dataset.column_names, data_args.dataset_format, data_args.dataset_name)
    data_report.enforce(data_args.max_dropped_share)
    protect_output_dir(recipe, training_args)  # never mix two recipes' checkpoints

    # ── Tokenizer ─────────────────────────────────────────────────────────────────────────────
    with training_args.main_process_first(local=False, desc="tiny model build"):
        model_path = resolve_model_path(model_args.model_name_or_path)
    tokenizer = load_tokenizer(model_args, model_path)
    if cli.audit_data:
        if data_args.dataset_format not in CHAT_FORMATS:
            raise ValueError(f"--audit-data checks chat assistant masks: it needs dataset_format in {CHAT_FORMATS}.")
        max_length = None if data_args.pack_blocks else training_args.max_length  # packing splits, never cuts
        report = audit_dataset(raw_dataset, tokenizer, cli.audit_data, max_length=max_length,
                               **(data_args.chat_template_kwargs or {}))
        print(format_report(report))
        return 0
    with global_then_local_main_first():  # prepared once per datasets cache (shared or node-local), not per rank
        raw_dataset = apply_length_policy(raw_dataset, data_args, training_args, tokenizer, data_report)
        train_dataset, data_collator = prepare_train_dataset(raw_dataset, data_args, tokenizer, training_args,
                                                              data_report)
    if is_main:
        print(data_report.format(), flush=True)
    data_report.enforce(data_args.max_dropped_share)

    # ── Model ─────────────────────────────────────────────────────────────────────────────────
    if data_args.pack_blocks:  # seconds on a tiny copy: refuse an architecture that would leak
        check_packing_leak(AutoConfig.from_pretrained(model_path), model_args.attn_implementation)
    model = load_model(model_args, model_path)
    if frozen := freeze_vision_tower(model):  # text-only SFT of a VLM checkpoint: kept, exported, not trained
        logger.info("vision tower frozen (%s parameters): text-only data never updates it", f"{frozen:,}")
    if data_args.pack_blocks:
        prepare_for_packing(model)
    wrap_classes = pin_fsdp_wrap_classes(model, training_args.fsdp_wrap_classes)  # from the model, not guesses
    if model_args.use_peft:
        model = apply_lora(model, model_args, seed=training_args.seed)  # logs the ranks really applied
        guard_lora_fsdp_layout(model, wrap_classes)  # at the first step: LoRA sharded with its decoder layer

    # ── Trainer ───────────────────────────────────────────────────────────────────────────────
    tracking_uri = configure_mlflow(training_args, model_args.mlflow_experiment_name)
    summary = RunSummaryCallback()
    lora_config = build_lora_config(model_args) if model_args.use_peft else None
    adapter_saves = [AdapterCheckpointCallback()] if model_args.use_peft else []  # checkpoints in PEFT format too
    throughput = ThroughputMeter.for_run(AutoConfig.from_pretrained(model_path), lora_config, training_args.device)
    trainer = RecipeSFTTrainer(
        model=model,
        throughput=throughput,  # tokens/s per device, MFU, peak memory in every log
        args=training_args,
        train_dataset=train_dataset,
        data_collator=data_collator,
        processing_class=tokenizer,
        callbacks=[RecipeParamsCallback(recipe.values), summary, DataReportCallback(data_report), *adapter_saves,
                   *fault_tolerance_callbacks(training_args, recipe_identity(recipe))],
    )
    for callback in adapter_saves:
        callback.trainer = trainer
    layout = verify_distributed(trainer)
    set_fsdp_reduce_dtype(trainer, training_args.fsdp_reduce_dtype)
    if is_main:
        logger.info("distributed: %s; throughput: %s", layout, throughput.describe())

    # ── Train ─────────────────────────────────────────────────────────────────────────────────
    resume_from = resolve_resume_checkpoint(training_args)
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume_from)
    train_seconds = time.perf_counter() - start

    # ── Save ──────────────────────────────────────────────────────────────────────────────────
    output_dir, logit_diff = export_run(trainer, model_args, training_args.output_dir,
                                        load_base=lambda: load_model(model_args, model_path))
    if is_main:
        report = summary.finish(train_seconds, output_dir, tracking_uri, logit_diff, resume_from, layout)
        Path(output_dir, "run_summary.json").write_text(json.dumps(report, indent=2))
        print(summary.closing_line(report), flush=True)
    return 0


def dry_run(cli: argparse.Namespace, overrides: list[str]) -> int:
    """Lint and plan the run a launch would make, without GPUs or weights."""
    try:
        accelerate_config = accelerate_config_for_plan(cli.config_file, cli.recipe)
        if accelerate_config:
            export_launch_environment(accelerate_config)
        world_size = planned_world_size(accelerate_config, cli.world_size)
        recipe = load_recipe(cli.recipe, overrides, planning=True)
        lint_recipe(recipe, LintContext(world_size, not recipe.values.get("use_cpu"),
                                        lambda: load_model_config(recipe.model.model_name_or_path)))
        plan = plan_recipe(recipe, accelerate_config, world_size)
    except (RecipeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    if cli.plan_json:
        Path(cli.plan_json).write_text(plan.to_json())
        print(f"plan written to {cli.plan_json}")
    return 0


if __name__ == "__main__":
    with process_group_destroyed_on_exit():
        exit_code = main()
    sys.exit(exit_code)
