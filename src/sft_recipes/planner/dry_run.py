"""`scripts/sft.py RECIPE --dry-run`: lint the run a launch would make, plan it, and print the plan, the
layouts compared and what to change (`report`), with what image data adds (`vision`).
"""

from __future__ import annotations

import contextlib
import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from sft_recipes.errors import RecipeError
from sft_recipes.launch import AccelerateConfig, config_for_recipe, header_accelerate_config, planned_world_size
from sft_recipes.loading import read_model_config
from sft_recipes.planner.communication import Links
from sft_recipes.planner.layouts import LayoutReport, layout_report, shard_group_shortfall
from sft_recipes.planner.report import Plan, format_layouts, format_plan, plan_recipe
from sft_recipes.planner.setup import header_gpu, launch_mesh

if TYPE_CHECKING:
    from sft_recipes.config import Recipe


def plan_dry_run(recipe_path: str, overrides: list[str], config_file: str | None = None,
                 world_size: int | None = None, plan_json: str | None = None, gpu: str | None = None,
                 intra_node_gbps: float | None = None, inter_node_gbps: float | None = None) -> str:
    """`scripts/sft.py RECIPE --dry-run`: lint the run a launch would make and return its plan, as text.

    RecipeError for anything that stops the plan (the recipe, the launcher's settings, the model's config).
    """
    accelerate_config = config_for_recipe(config_file, recipe_path)
    with accelerate_config.exported() if accelerate_config else contextlib.nullcontext():  # what lint reads
        return _dry_run_text(recipe_path, overrides, accelerate_config, config_file, world_size, plan_json, gpu,
                             intra_node_gbps, inter_node_gbps)


def _dry_run_text(recipe_path: str, overrides: list[str], accelerate_config: AccelerateConfig | None,
                  config_file: str | None, world_size: int | None, plan_json: str | None, gpu: str | None,
                  intra_node_gbps: float | None, inter_node_gbps: float | None) -> str:
    from sft_recipes.config import load_recipe
    from sft_recipes.data.mixture import has_images
    from sft_recipes.lint import LintContext, lint_recipe
    from sft_recipes.reporting.hub import refuse_a_push_without_an_id

    world_size = planned_world_size(accelerate_config, world_size)
    recipe = load_recipe(recipe_path, overrides, planning=True)
    model_args = recipe.model
    lint_recipe(recipe, LintContext(world_size, not recipe.values.get("use_cpu"), lambda: read_model_config(
        model_args.model_name_or_path, model_args.model_revision, download=False)))
    refuse_a_push_without_an_id(recipe.training)
    nodes, replicate = launch_mesh(accelerate_config, world_size)
    gpu = gpu or header_gpu(recipe_path)
    try:
        plan = plan_recipe(recipe, accelerate_config, world_size, replicate_size=replicate)
        layouts = plan_layouts(recipe, plan, accelerate_config, config_file or header_accelerate_config(recipe_path),
                               nodes, gpu, intra_node_gbps, inter_node_gbps)
    except ValueError as err:  # the model's config, or sizes the planner cannot take
        raise RecipeError(str(err)) from None
    command = launch_command(config_file or header_accelerate_config(recipe_path) or "CONFIG", recipe_path, overrides,
                             nodes)
    text = format_plan(plan) + "\n" + format_layouts(layouts, command)
    if has_images(recipe.data):  # what the tower and the images add (planner/vision.py)
        from sft_recipes.planner.vision import vision_plan_lines

        config = read_model_config(model_args.model_name_or_path, model_args.model_revision, download=False)
        text = "\n".join([*vision_plan_lines(recipe, config, world_size), text])
    if plan_json:
        try:
            Path(plan_json).parent.mkdir(parents=True, exist_ok=True)
            Path(plan_json).write_text(json.dumps({**plan.to_dict(), **layouts.to_dict()}, indent=2))
        except OSError as err:  # e.g. a folder on its path is a file, or is not writable
            raise RecipeError(f"--plan-json {plan_json} cannot be written ({err.strerror}: {err.filename}): pass a "
                              "file path in a folder you can write to.") from None
        text += f"\nplan written to {plan_json}"
    return text


def launch_command(config_name: str | Path, recipe_path: str, overrides: list[str], nodes: int) -> str:
    """What the user runs to launch the run planned: `accelerate launch` on one node; on several, the command every
    node runs (scripts/launch_multinode.sh, which `make llama-multinode` and the workloads' command run too)."""
    launcher = f"scripts/launch_multinode.sh {config_name}" if nodes > 1 else \
        f".venv/bin/accelerate launch --config_file {config_name} scripts/sft.py"
    return f"{launcher} {shlex.join([recipe_path, *overrides])}"  # a YAML value with spaces stays one argument


def plan_layouts(recipe: Recipe, plan: Plan, accelerate_config: AccelerateConfig | None, config_name: str | Path | None,
                 nodes: int, gpu: str, intra_node_gbps: float | None, inter_node_gbps: float | None) -> LayoutReport:
    """The communication, FSDP-vs-HSDP and what-to-change part of the dry run; refuses an HSDP shard group
    that cannot hold the run on ``gpu`` (the shortfall and the smallest shard size that fits)."""
    config = read_model_config(recipe.model.model_name_or_path, recipe.model.model_revision, download=False)
    links = Links.for_gpu(gpu, intra_node_gbps, inter_node_gbps)
    setup = plan.setup
    if setup.replicate_size > 1:
        shortfall = shard_group_shortfall(config, plan.counts, setup, gpu)
        if shortfall is not None:
            shard = shortfall.smallest_fitting_shard
            fix = (f"the smallest shard size that fits is {shard} " + (
                   f"(parallelism_config_dp_shard_size: {shard}, parallelism_config_dp_replicate_size: "
                   f"{setup.world_size // shard})" if shard and shard < setup.world_size else
                   "(every GPU: flat FSDP, a config without parallelism_config)")
                   if shortfall.smallest_fitting_shard else
                   "no shard size fits either, flat FSDP over all ranks included: see the plan without "
                   "parallelism_config for what to change")
            raise RecipeError(f"HSDP shard group of {setup.shard_size} GPUs cannot hold this run on {gpu}: "
                              f"{shortfall.needed_gib:.1f} GiB per GPU, {shortfall.shortfall_gib:.1f} GiB more than "
                              f"its {shortfall.available_gib:.1f}; {fix}.")
    fsdp = accelerate_config.fsdp if accelerate_config else {}
    reshard = str(fsdp.get("fsdp_reshard_after_forward", True)).lower() == "true"
    t = recipe.training
    from sft_recipes.config import GLOBAL_BATCH_KEYS
    from sft_recipes.lint import LintContext, sequence_parallel_sizes_the_recipe_takes

    sequence_parallel_sizes = sequence_parallel_sizes_the_recipe_takes(  # never suggest a size the run refuses
        recipe, LintContext(setup.world_size, True, lambda: config), list(range(1, setup.world_size // nodes + 1)))
    return layout_report(config, plan.counts, setup, nodes, gpu, links, str(config_name) if config_name else None,
                         next((key for key in GLOBAL_BATCH_KEYS if getattr(t, key) is not None), None), reshard,
                         sequence_parallel_sizes, t.plan_memory_headroom_gib)
