"""GPU launches on a machine without the GPUs they need: one line, exit 2, before any process starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import REPO_ROOT, bin_path, run_command
from sft_recipes.preflight_launch import preflight


@pytest.mark.parametrize(("config", "recipe"), [("fsdp2_8gpu.yaml", "qwen27b.yaml"), ("fsdp2_8gpu.yaml", "gptoss120b.yaml"),
                                                ("fsdp2_2node.yaml", "llama8b.yaml")])
def test_gpu_recipe_without_gpus_is_refused_with_what_to_run_instead(config, recipe):
    problem = preflight(f"accelerate_configs/{config}", f"recipes/{recipe}", None, gpu_count=0)
    assert problem.startswith(f"accelerate_configs/{config} + recipes/{recipe} need 8 GPU(s) on this node")
    assert "this machine has no GPU" in problem and "`make demo`" in problem and "--dry-run" in problem


def test_enough_gpus_or_a_cpu_run_go_ahead():
    assert preflight("accelerate_configs/fsdp2_8gpu.yaml", "recipes/qwen27b.yaml", None, gpu_count=8) is None
    assert preflight("accelerate_configs/fsdp2_cpu.yaml", "recipes/tiny/llama8b.yaml", None, gpu_count=0) is None
    assert "need 8 GPU(s)" in preflight("accelerate_configs/fsdp2_8gpu.yaml", "recipes/qwen27b.yaml", None, gpu_count=4)
    # launch_multinode.sh passes the processes it will start on this node (its GPU count when it sees GPUs)
    assert preflight("accelerate_configs/fsdp2_2node.yaml", "recipes/llama8b.yaml", 4, gpu_count=4) is None


def test_launch_script_stops_before_starting_anything():
    result = run_command(["bash", str(REPO_ROOT / "scripts" / "launch_multinode.sh"), "accelerate_configs/fsdp2_2node.yaml",
                          "recipes/llama8b.yaml"],
                         env={"PATH": f"{Path(bin_path('python')).parent}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: accelerate_configs/fsdp2_2node.yaml + recipes/llama8b.yaml"), lines
    assert "[launch]" not in result.stderr  # accelerate was never started
