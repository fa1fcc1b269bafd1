"""`python -m sft_recipes.new_workload`: a workload for your own recipe that passes the offline check."""

from __future__ import annotations

import pytest
import yaml

from conftest import REPO_ROOT
from sft_recipes.errors import RecipeError
from sft_recipes.new_workload import build_workload, main
from sft_recipes.workload import check_workload, launched

LLAMA_CONFIG = REPO_ROOT / "data" / "realworld" / "model_configs" / "meta-llama__Llama-3.1-8B.json"


def test_a_written_workload_passes_the_check_and_matches_the_shipped_one(tmp_path, capsys):
    output = tmp_path / "mine.yaml"
    assert main(["recipes/llama8b.yaml", "--accelerator", "GPU_8xH100", "--nodes", "2", "--output-dir",
                 "/Volumes/ml/sft/checkpoints/llama", "--hf-token-secret", "ml_team/hf_token", "-o", str(output),
                 "--model-config", str(LLAMA_CONFIG)]) == 0
    assert capsys.readouterr().err == ""  # not a warning: nothing left to replace
    assert check_workload(output, str(LLAMA_CONFIG)) == []
    written, shipped = yaml.safe_load(output.read_text()), yaml.safe_load((REPO_ROOT / "workloads/llama8b.yaml").read_text())
    for key in ("experiment_name", "environment", "compute", "max_retries"):
        assert written[key] == shipped[key], key
    assert launched(written["command"], {}) == launched(shipped["command"], {})  # fsdp2_2node.yaml, recipes/llama8b.yaml
    assert written["secrets"] == {"HF_TOKEN": "ml_team/hf_token"}
    assert written["parameters"] == {"output_dir": "/Volumes/ml/sft/checkpoints/llama"}


def test_what_was_not_given_is_a_placeholder_the_check_warns_about(tmp_path):
    output = tmp_path / "tools.yaml"
    assert main(["recipes/examples/llama8b_tools.yaml", "--accelerator", "GPU_8xH100", "-o", str(output),
                 "--model-config", str(LLAMA_CONFIG)]) == 0
    written = yaml.safe_load(output.read_text())
    assert written["compute"] == {"num_accelerators": 8, "accelerator_type": "GPU_8xH100"}
    assert "accelerate_configs/fsdp2_8gpu.yaml recipes/examples/llama8b_tools.yaml" in written["command"]
    assert [(p.warning, p.message.split(" is the example's placeholder")[0])
            for p in check_workload(output, str(LLAMA_CONFIG))] == [
        (True, "secrets.HF_TOKEN 'my_scope/hf_token'"),
        (True, "output_dir '/Volumes/main/default/air_checkpoints/sft-recipes-llama8b-tools'")]


def test_a_layout_with_no_config_or_a_recipe_outside_the_repository_is_refused(tmp_path):
    with pytest.raises(RecipeError, match=r"^accelerate_configs/ has no FSDP2 config for 1 node\(s\) x 1 GPU\(s\): copy "):
        build_workload("recipes/llama8b.yaml", "GPU_1xH100", 1, tmp_path / "w.yaml")
    outside = tmp_path / "recipe.yaml"
    outside.write_text((REPO_ROOT / "recipes/llama8b.yaml").read_text())
    with pytest.raises(RecipeError, match=r"is outside the repository .*: copy it into the repository"):
        build_workload(outside, "GPU_8xH100", 1, tmp_path / "w.yaml")
