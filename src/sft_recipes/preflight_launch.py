"""Before a launch: does this machine have the accelerators the accelerate config and the recipe ask for?

    python -m sft_recipes.preflight_launch ACCELERATE_CONFIG RECIPE [--processes-per-node N]

Run by scripts/launch_multinode.sh and the GPU Makefile targets before `accelerate launch`: without
it, a GPU recipe on a laptop starts one process per configured GPU, each fails with transformers'
"Your setup doesn't support bf16/gpu", and torchrun prints a wall of tracebacks. Exits 2 with one
`error:` line naming what is missing and what to run instead; 0 when the launch can go ahead.
Reads only the two YAML files and the GPU count (about a second; nothing of the run is imported); what
the config launches is `sft_recipes.launch`'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from sft_recipes.launch import gpus_needed, read_accelerate_config


def preflight(config_path: str, recipe_path: str, processes_per_node: int | None, gpu_count: int) -> str | None:
    """The one-line refusal, or None when this machine can run the launch."""
    for path in (config_path, recipe_path):
        if not Path(path).is_file():
            return f"{path} not found"
    recipe = yaml.safe_load(Path(recipe_path).read_text()) or {}
    needed, why = gpus_needed(read_accelerate_config(config_path), recipe, processes_per_node)
    if gpu_count >= needed:
        return None
    have = "no GPU" if gpu_count == 0 else f"{gpu_count} GPU(s)"
    return (f"{config_path} + {recipe_path} need {needed} GPU(s) on this node ({why}) and this machine has {have}; "
            f"to try the recipes here run `make demo` (its tiny twin on 2 CPU processes), to see this run's plan "
            f"`.venv/bin/python scripts/sft.py {recipe_path} --dry-run --config_file {config_path}`")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("recipe")
    parser.add_argument("--processes-per-node", type=int, help="default: the config's num_processes / num_machines")
    args = parser.parse_args(argv)
    import torch

    problem = preflight(args.config, args.recipe, args.processes_per_node, torch.cuda.device_count())
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
