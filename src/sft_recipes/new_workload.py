"""Write a Databricks AI Runtime workload for your own recipe, then check it (docs/ai-runtime.md).

    .venv/bin/python -m sft_recipes.new_workload my_recipe.yaml --accelerator GPU_8xH100 --nodes 2 \\
        --output-dir /Volumes/ml/sft/checkpoints/mine --hf-token-secret ml_team/hf_token -o workloads/mine.yaml

The file is what the shipped workloads are, for your recipe: the launcher command with the repository's
accelerate config for nodes x GPUs per node (FSDP2; HSDP configs are picked by hand), requirements.txt's
pins, `output_dir` on a volume, the recipe's MLflow experiment as experiment_name, retries that resume.
What only you know and did not give stays a placeholder the check warns about (`my_scope/hf_token`,
`/Volumes/main/default/...`). It is then checked as `python -m sft_recipes.workload check` checks it;
its lines are printed, and an error (e.g. a plan that does not fit the GPU) exits 2.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import yaml

from sft_recipes.command_line import OneLineParser, positive_int
from sft_recipes.config import read_recipe_file
from sft_recipes.errors import RecipeError, one_line_refusals
from sft_recipes.launch import read_accelerate_config
from sft_recipes.workload import (
    DEFAULT_MAX_RETRIES,
    GATED_MODEL_PREFIXES,
    GPUS_PER_NODE,
    LAUNCHER,
    PLACEHOLDER_SECRET_SCOPE,
    PLACEHOLDER_VOLUME,
    check_workload,
    format_problems,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
# Installed by the image, not by the workload: its CUDA build of torch (as in the seeds).
IMAGE_PACKAGES = ("torch",)
# The seeds' reason: the image's fsspec 2023.5.0 breaks huggingface_hub (workloads/llama8b.yaml's header).
RUNTIME_EXTRA = ("fsspec==2026.9.0",)


def accelerate_config_for(nodes: int, per_node: int) -> str:
    """The repository's FSDP2 config that launches nodes x per_node processes on GPUs (relative to the root)."""
    fitting = []
    for path in sorted((REPO_ROOT / "accelerate_configs").glob("*.yaml")):
        config = read_accelerate_config(path)
        if (config.num_machines, config.processes_per_node) == (nodes, per_node) and not config.uses_cpu \
                and config.uses_fsdp and config.parallelism is None:
            fitting.append(path.relative_to(REPO_ROOT).as_posix())
    if not fitting:
        raise RecipeError(f"accelerate_configs/ has no FSDP2 config for {nodes} node(s) x {per_node} GPU(s): copy "
                          "accelerate_configs/fsdp2_2node.yaml, set num_machines and num_processes, and write the "
                          "workload by hand from workloads/llama8b.yaml (docs/ai-runtime.md)")
    return fitting[0]


def dependencies() -> list[str]:
    pins = [line.split("#")[0].strip() for line in (REPO_ROOT / "requirements.txt").read_text().splitlines()]
    return [pin for pin in pins if "==" in pin and pin.split("==")[0] not in IMAGE_PACKAGES] + list(RUNTIME_EXTRA)


def build_workload(recipe: str | os.PathLike, accelerator: str, nodes: int, output: Path,
                   output_dir: str | None = None, hf_token_secret: str | None = None) -> dict:
    """The workload for `recipe` (a path inside the repository) on `nodes` nodes of `accelerator`."""
    recipe_path = Path(recipe).resolve()
    if not recipe_path.is_relative_to(REPO_ROOT):
        raise RecipeError(f"{recipe} is outside the repository {REPO_ROOT}, which the workload uploads "
                          "(code_source.root_path): copy it into the repository (e.g. recipes/mine.yaml)")
    if accelerator not in GPUS_PER_NODE:
        raise RecipeError(f"--accelerator {accelerator!r} is not a type the runtime knows: use one of "
                          f"{', '.join(GPUS_PER_NODE)}")
    if nodes < 1:
        raise RecipeError(f"--nodes {nodes} must be 1 or more")
    values = read_recipe_file(recipe_path)
    per_node = GPUS_PER_NODE[accelerator]
    config = accelerate_config_for(nodes, per_node)
    relative_recipe = recipe_path.relative_to(REPO_ROOT).as_posix()
    name = values.get("mlflow_experiment_name") or re.sub(r"[^A-Za-z0-9_-]", "-", recipe_path.stem)
    parameters: dict = {"output_dir": output_dir or f"{PLACEHOLDER_VOLUME}air_checkpoints/{name}"}
    if values.get("resume_from_checkpoint") != "auto":  # a retry continues from the newest checkpoint
        parameters["resume_from_checkpoint"] = "auto"
    if "mlflow" in str(values.get("report_to")) and values.get("mlflow_experiment_name") != name:
        parameters["mlflow_experiment_name"] = name  # the runtime's MLflow run and ours: one experiment
    env_variables = {"HF_HOME": "/tmp/hf"}
    if nodes > 1:
        env_variables["NCCL_SOCKET_IFNAME"] = "eth0"  # the seeds' interface for the cross-node rendezvous
    workload = {
        "experiment_name": name,
        "environment": {"version": "databricks_ai_v6", "dependencies": dependencies()},
        "compute": {"num_accelerators": nodes * per_node, "accelerator_type": accelerator},
        "code_source": {"root_path": os.path.relpath(REPO_ROOT, output.resolve().parent)},
        "command": ('cd "$CODE_SOURCE_PATH"\n'
                    'export PYTHONPATH="$CODE_SOURCE_PATH/src${PYTHONPATH:+:$PYTHONPATH}"\n'
                    f"{LAUNCHER} {config} {relative_recipe}\n"),
        "env_variables": env_variables,
    }
    model = str(values.get("model_name_or_path", ""))
    if hf_token_secret or model.startswith(GATED_MODEL_PREFIXES):
        workload["secrets"] = {"HF_TOKEN": hf_token_secret or f"{PLACEHOLDER_SECRET_SCOPE}hf_token"}
    workload |= {"max_retries": DEFAULT_MAX_RETRIES, "timeout_minutes": 120, "parameters": parameters}
    return workload


class _Dumper(yaml.SafeDumper):
    """The command as a `|` block, as the shipped workloads write it (not one quoted string)."""


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m sft_recipes.new_workload", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="your recipe, inside this repository (the workload uploads it)")
    parser.add_argument("--accelerator", required=True, choices=tuple(GPUS_PER_NODE), help="compute.accelerator_type")
    parser.add_argument("--nodes", type=positive_int("the number of nodes (default 1)"), default=1,
                        help="nodes of that type (default 1)")
    parser.add_argument("--output-dir", help="parameters.output_dir, on a volume: /Volumes/<catalog>/<schema>/<volume>/...")
    parser.add_argument("--hf-token-secret", help="your Databricks secret's scope/key holding a Hugging Face token")
    parser.add_argument("--model-config", help="plan the check on this config.json (default: the Hugging Face cache)")
    parser.add_argument("-o", "--output", required=True, help="the workload file to write, e.g. workloads/mine.yaml")
    args = parser.parse_args(argv)
    output = Path(args.output)
    workload = build_workload(args.recipe, args.accelerator, args.nodes, output, args.output_dir, args.hf_token_secret)
    output.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# {Path(args.recipe).name} on Databricks AI Runtime, {args.nodes} x {args.accelerator}: written by "
              "python -m sft_recipes.new_workload (docs/ai-runtime.md).\n"
              f"#   .venv/bin/python -m sft_recipes.workload check {output}\n"
              f"#   databricks air run -f {output} --watch\n\n")
    output.write_text(header + yaml.dump(workload, Dumper=_Dumper, sort_keys=False, width=120))
    problems = check_workload(output, args.model_config)
    for line in format_problems(output, problems):
        print(line, file=sys.stderr)
    print(f"wrote {output}")
    return 2 if any(not problem.warning for problem in problems) else 0


if __name__ == "__main__":
    sys.exit(one_line_refusals(main))
