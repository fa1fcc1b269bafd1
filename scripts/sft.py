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

from sft_recipes.config import RecipeError, load_recipe
from sft_recipes.data.audit import audit_dataset, format_report
from sft_recipes.data.formats import check_columns
from sft_recipes.data.sources import load_raw_dataset
from sft_recipes.data.prepare import prepare_train_dataset
from sft_recipes.distributed import enable_cpu_fsdp, set_fsdp_reduce_dtype, verify_distributed
from sft_recipes.export import export_consolidated, first_input_ids, verify_export
from sft_recipes.lint import lint_recipe
from sft_recipes.modeling import load_model, load_tokenizer, resolve_model_path
from sft_recipes.models import check_packing_leak, prepare_for_packing
from sft_recipes.runs import RunSummaryCallback, resolve_resume_checkpoint
from sft_recipes.tracking import RecipeParamsCallback, configure_mlflow
from sft_recipes.trainer import RecipeSFTTrainer

logger = logging.getLogger("sft")


def parse_command_line(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/llama8b.yaml")
    parser.add_argument("--dry-run", action="store_true", help="check the recipe and stop before loading weights")
    parser.add_argument("--audit-data", type=int, metavar="N", default=0,
                        help="show N conversations with their supervised spans marked, report mask statistics, stop")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)

    # ── Parse ─────────────────────────────────────────────────────────────────────────────────
    cli, overrides = parse_command_line(sys.argv[1:] if argv is None else argv)
    try:
        recipe = load_recipe(cli.recipe, overrides)
        lint_recipe(recipe)
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    data_args, model_args, training_args = recipe.data, recipe.model, recipe.training
    enable_cpu_fsdp()  # before the Trainer creates its Accelerator: FSDP2 on CPU too
    is_main = training_args.process_index == 0
    if is_main:
        logger.info("recipe %s -> output_dir %s", recipe.source, training_args.output_dir)

    # ── Data ──────────────────────────────────────────────────────────────────────────────────
    raw_dataset = load_raw_dataset(data_args)
    check_columns(raw_dataset.column_names, data_args.dataset_format, data_args.dataset_name)
    if cli.dry_run:
        print(f"dry run: recipe {recipe.source} is valid; dataset columns {raw_dataset.column_names}")
        return 0

    # ── Tokenizer ─────────────────────────────────────────────────────────────────────────────
    with training_args.main_process_first(local=False, desc="tiny model build"):
        model_path = resolve_model_path(model_args.model_name_or_path)
    tokenizer = load_tokenizer(model_args, model_path)
    if cli.audit_data:
        if data_args.dataset_format != "messages":
            raise ValueError("--audit-data checks chat assistant masks: it needs dataset_format: messages.")
        max_length = None if data_args.pack_blocks else training_args.max_length  # packing splits, never cuts
        report = audit_dataset(raw_dataset, tokenizer, cli.audit_data, max_length=max_length,
                               **(data_args.chat_template_kwargs or {}))
        print(format_report(report))
        return 0
    with training_args.main_process_first(desc="dataset preparation"):
        train_dataset, data_collator = prepare_train_dataset(raw_dataset, data_args, tokenizer, training_args)

    # ── Model ─────────────────────────────────────────────────────────────────────────────────
    if data_args.pack_blocks:  # seconds on a tiny copy: refuse an architecture that would leak
        check_packing_leak(AutoConfig.from_pretrained(model_path), model_args.attn_implementation)
    model = load_model(model_args, model_path)
    if data_args.pack_blocks:
        prepare_for_packing(model)

    # ── Trainer ───────────────────────────────────────────────────────────────────────────────
    tracking_uri = configure_mlflow(training_args, model_args.mlflow_experiment_name)
    summary = RunSummaryCallback()
    trainer = RecipeSFTTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        data_collator=data_collator,
        processing_class=tokenizer,
        callbacks=[RecipeParamsCallback(recipe.values), summary],
    )
    layout = verify_distributed(trainer)
    set_fsdp_reduce_dtype(trainer, training_args.fsdp_reduce_dtype)
    if is_main:
        logger.info("distributed: %s", layout)

    # ── Train ─────────────────────────────────────────────────────────────────────────────────
    resume_from = resolve_resume_checkpoint(training_args)
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume_from)
    train_seconds = time.perf_counter() - start

    # ── Save ──────────────────────────────────────────────────────────────────────────────────
    output_dir = export_consolidated(trainer, training_args.output_dir, model_args.export_dtype)
    logit_diff = None
    if model_args.verify_export:
        probe_ids = first_input_ids(trainer.training_data)[:64]
        logit_diff = verify_export(trainer, output_dir, probe_ids)
    if is_main:
        report = summary.finish(train_seconds, output_dir, tracking_uri, logit_diff, resume_from, layout)
        Path(output_dir, "run_summary.json").write_text(json.dumps(report, indent=2))
        print(summary.closing_line(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
