"""The workloads keep the recipes' stated global batch: a fixed accumulation in `parameters:` is refused by the
offline check, as the run itself would refuse it (sft_recipes.lint.batch_the_world_cannot_produce)."""

from __future__ import annotations

import pytest
import yaml

from conftest import REPO_ROOT
from sft_recipes.workload import cross_file_problems

WORKLOADS = sorted((REPO_ROOT / "workloads").glob("*.yaml"))


def errors(workload: dict, path) -> list[str]:
    return [problem.message for problem in cross_file_problems(workload, path) if not problem.warning]


@pytest.mark.parametrize("path", WORKLOADS, ids=lambda path: path.name)
def test_shipped_workloads_keep_their_recipes_global_batch(path):
    assert not [message for message in errors(yaml.safe_load(path.read_text()), path) if "global batch" in message]


def test_a_fixed_accumulation_in_parameters_is_refused_naming_the_fix():
    path = REPO_ROOT / "workloads" / "qwen27b-h100.yaml"
    workload = yaml.safe_load(path.read_text())
    workload["parameters"]["gradient_accumulation_steps"] = 2  # 2 SP groups x 2 = 4 blocks, not the recipe's 8
    assert ("the recipe with parameters on 8 GPUs: global_batch_size: 8 (recipe) and gradient_accumulation_steps: 2 "
            "(workload) are both set, and a fixed accumulation would change the global batch on another layout; drop "
            "gradient_accumulation_steps") in " | ".join(errors(workload, path))


def test_the_check_orders_parameters_then_the_command_as_the_run_does():
    path = REPO_ROOT / "workloads" / "qwen27b-h100.yaml"
    workload = yaml.safe_load(path.read_text())
    # A global batch on the command replaces a fixed accumulation in parameters (the run reads the command last) ...
    workload["parameters"]["gradient_accumulation_steps"] = 2
    workload["command"] = workload["command"].replace("${SFT_ARGS:-}", "--global_batch_size 16")
    assert not [message for message in errors(workload, path) if "global batch" in message]
    # ... and a fixed accumulation on the command beside a global batch in parameters stays refused.
    del workload["parameters"]["gradient_accumulation_steps"]
    workload["parameters"]["global_batch_size"] = 16
    workload["command"] = workload["command"].replace("--global_batch_size 16", "--gradient_accumulation_steps 2")
    assert ("global_batch_size: 16 (workload) and gradient_accumulation_steps: 2 (workload) are both set"
            in " | ".join(errors(workload, path)))
