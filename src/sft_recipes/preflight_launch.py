"""Before a launch: can this machine run it, and does the recipe (with its overrides) stand?

    .venv/bin/python -m sft_recipes.preflight_launch ACCELERATE_CONFIG RECIPE [--processes-per-node N]
        [--world-size N] [-- --key value ...]

Run by scripts/launch_multinode.sh and the Makefile's training targets before `accelerate launch`, so
that a refusal is one `error:` line (exit 2) before any process starts. Without it, torchrun starts
one process per GPU, each refuses, and torchrun's ChildFailedError report buries our line under ~40
lines of its own (and `tail` shows only those).

Two checks, in this order:
1. GPUs: a GPU recipe on a laptop would start one process per configured GPU, each failing with
   transformers' "Your setup doesn't support bf16/gpu". Reads the two YAML files and the GPU count.
2. The recipe: parsed with the overrides the launch will pass (every key, type and range), the mixture's entries,
   local data paths, a local model path and a resume_from_checkpoint path, the Hub push's id and token (the token
   asked of the Hub, once per node), an MLflow tracking server that does not answer, and every lint rule that needs
   no model config (world size, launcher settings as the accelerate config exports them). A few seconds: the recipe
   dataclasses import TRL, nothing loads a model or data. The rules that need the model's config.json run again at
   start, in every process.
What the config launches (nodes, processes per node) is `sft_recipes.launch`'s.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from sft_recipes.command_line import OneLineParser, options_that_do_not_train
from sft_recipes.errors import RecipeError
from sft_recipes.launch import gpus_needed, read_accelerate_config


def preflight(config_path: str, recipe_path: str, processes_per_node: int | None, gpu_count: int) -> str | None:
    """The one-line refusal, or None when this machine can run the launch."""
    from sft_recipes.config import read_recipe_file  # sft.py's refusals of a recipe file (missing, a folder, bad YAML)

    try:
        config = read_accelerate_config(config_path)
        recipe = read_recipe_file(recipe_path)
    except RecipeError as err:
        return str(err)
    needed, why = gpus_needed(config, recipe, processes_per_node)
    if gpu_count >= needed:
        return None
    have = "no GPU" if gpu_count == 0 else f"{gpu_count} GPU(s)"
    return (f"{config_path} + {recipe_path} need {needed} GPU(s) on this node ({why}) and this machine has {have}; "
            f"to try the recipes here run `make demo` (its tiny twin on 2 CPU processes), to see this run's plan "
            f"`.venv/bin/python scripts/sft.py {recipe_path} --dry-run --config_file {config_path}`")


def recipe_refusal(config_path: str, recipe_path: str, overrides: list[str], world_size: int | None,
                   has_accelerator: bool) -> str | None:
    """What the run would refuse at start, without a model: parse, data-source keys, Hub push, lint. None: it stands."""
    from sft_recipes.config import load_recipe
    from sft_recipes.data.mixture import eval_sources, training_sources
    from sft_recipes.data.sources import refuse_missing_local_path
    from sft_recipes.errors import RecipeError
    from sft_recipes.fault.resume import refuse_a_resume_path_without_a_checkpoint
    from sft_recipes.lint import LintContext, lint_recipe
    from sft_recipes.loading import refuse_a_missing_local_model
    from sft_recipes.reporting.hub import refuse_a_token_that_cannot_push, take_over_hub_push
    from sft_recipes.reporting.tracking import refuse_a_tracking_server_that_does_not_answer

    try:
        accelerate_config = read_accelerate_config(config_path)
        with accelerate_config.exported():  # for the rules, which read what the launch exports
            recipe = load_recipe(recipe_path, overrides, planning=not has_accelerator)
            data = recipe.data
            where = "datasets" if data.datasets else "dataset_name"
            for key, sources in ((where, training_sources(data)), ("eval_datasets", eval_sources(data))):
                for source in sources:
                    if source.path:
                        refuse_missing_local_path(source.path, key)
            refuse_a_missing_local_model(recipe.model.model_name_or_path)
            refuse_a_resume_path_without_a_checkpoint(recipe.training.resume_from_checkpoint,
                                                      recipe.training.output_dir)
            if push := take_over_hub_push(recipe.training):
                refuse_a_token_that_cannot_push(push)
            refuse_a_tracking_server_that_does_not_answer(recipe.training, recipe.model.mlflow_experiment_name)
            world = world_size or accelerate_config.num_processes
            lint_recipe(recipe, LintContext(world_size=world, has_accelerator=has_accelerator))
    except RecipeError as err:
        return str(err)
    return None


def launch_of_an_option_that_does_not_train(recipe_path: str, overrides: list[str]) -> str | None:
    """`make train ARGS="--dry-run"`: the dry run and the data audit run in one process, on their own."""
    options = options_that_do_not_train(recipe_path, overrides)
    if not options:
        return None
    own = "is scripts/sft.py's own option" if len(options) == 1 else "are scripts/sft.py's own options"
    return (f"{' '.join(options)} {own}: the dry run and the data audit run in one process instead of training, "
            f"so they are not launched: run `.venv/bin/python scripts/sft.py {recipe_path} {shlex.join(overrides)}`")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = OneLineParser(prog="python -m sft_recipes.preflight_launch", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("recipe")
    parser.add_argument("--processes-per-node", type=int, help="default: the config's num_processes / num_machines")
    parser.add_argument("--world-size", type=int, help="processes over all nodes; default: the config's num_processes")
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    import torch

    gpu_count = torch.cuda.device_count()
    problem = launch_of_an_option_that_does_not_train(args.recipe, overrides) or preflight(args.config, args.recipe, args.processes_per_node, gpu_count) or recipe_refusal(
        args.config, args.recipe, overrides, args.world_size, has_accelerator=gpu_count > 0)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
