"""`sft_recipes.train()`: one recipe run from Python, in a process a notebook decorator or torch.multiprocessing
started.

    from sft_recipes import train

    result = train("recipes/gptoss120b.yaml", accelerate_config="accelerate_configs/fsdp2_8gpu.yaml",
                   output_dir="/Volumes/main/default/checkpoints/gpt-oss-120b", max_steps=100)
    result.output_dir, result.losses, result.eval_loss, result.export_check, result.mlflow_run_id

Every rank calls it (serverless_gpu's `@distributed`, Databricks' `databricks.air.distributed`, a
`torch.multiprocessing` worker: each sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT). It runs
exactly what `accelerate launch --config_file CONFIG scripts/sft.py RECIPE --key value` runs (the same
steps, `sft_recipes.run.complete_run`), but a refusal raises `RecipeError` on every rank instead of
exiting, and the process is left able to run the next call (`sft_recipes.in_process`).
"""

from __future__ import annotations

import os
from typing import Any

from sft_recipes.config import load_recipe, read_recipe_file
from sft_recipes.errors import RecipeError
from sft_recipes.in_process import in_process_launch
from sft_recipes.run import RunResult, complete_run, earlier_result, start_run

OVERRIDES_SOURCE = "keyword_arguments"  # how run_summary.json and MLflow name train()'s overrides


def train(recipe: str | os.PathLike, accelerate_config: str | os.PathLike | None = None,
          **overrides: Any) -> RunResult:
    """Train `recipe` (a recipe YAML) with `overrides` (any recipe key) to its export and checks; every rank calls it.

    `accelerate_config`: the accelerate config file, applied as `accelerate launch --config_file` would
    (FSDP2 plugin, mixed precision, activation checkpointing); default: the one the recipe header's launch
    command names. Its num_processes must equal the caller's WORLD_SIZE. Precedence of values: the recipe
    < HYPERPARAMETERS_PATH (a workload's `parameters:`) < `overrides`.
    Raises RecipeError (on every rank) for anything a user can fix, with the fix in its message.
    """
    if accelerate_config is None:
        accelerate_config = _header_config(recipe)
    with in_process_launch(accelerate_config):
        run = start_run(load_recipe(recipe, overrides, overrides_source=OVERRIDES_SOURCE))
        return earlier_result(run) if run.finished else complete_run(run)


def _header_config(recipe: str | os.PathLike) -> str:
    from sft_recipes.launch import header_accelerate_config

    read_recipe_file(recipe)  # a missing or broken recipe is said as such, not as a header without a config
    named = header_accelerate_config(recipe)
    if named is None:
        raise RecipeError(f"{recipe} names no accelerate config in its header: pass "
                          "train(..., accelerate_config='accelerate_configs/<config>.yaml').")
    return str(named)
