"""`scripts/sft.py RECIPE --dry-run`: the shipped recipes planned on the real model configs, no GPU, no weights."""

from __future__ import annotations

import json
import re

import pytest

from conftest import REALWORLD, REPO_ROOT, bin_path, run_command

CONFIGS = REALWORLD / "model_configs"
KEYS = {"total_params", "trainable_params", "world_size", "tokens_per_step", "per_device_memory_gib", "fits"}


def dry_run(tmp_path, recipe, config_file, model_config, *overrides):
    plan_path = tmp_path / "plan.json"
    result = run_command([bin_path("python"), "scripts/sft.py", f"recipes/{recipe}", "--dry-run",
                          "--config_file", f"accelerate_configs/{config_file}", "--model_name_or_path",
                          str(CONFIGS / model_config), "--plan-json", str(plan_path), *overrides])
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(plan_path.read_text())
    assert KEYS <= set(plan) and {"params", "grads", "optimizer", "activations", "total"} <= set(plan["per_device_memory_gib"])
    return plan, result.stdout


def test_qwen27b_32k_blocks_fit_b300_not_h100(tmp_path):
    plan, printed = dry_run(tmp_path, "qwen27b.yaml", "fsdp2_8gpu.yaml", "Qwen__Qwen3.5-27B.derived.json")
    assert plan["fits"]["B300"] and not plan["fits"]["H100"]
    assert plan["world_size"] == 8 and plan["tokens_per_step"] == 8 * 32768
    assert "memory per GPU" in printed and "H100" in printed


def test_qwen27b_8k_blocks_fit_h100(tmp_path):
    plan, _ = dry_run(tmp_path, "qwen27b.yaml", "fsdp2_8gpu.yaml", "Qwen__Qwen3.5-27B.derived.json", "--max_length", "8192")
    assert plan["fits"]["H100"]


def test_qwen27b_32k_blocks_fit_h100_with_sequence_parallel_size_4_at_the_same_batch(tmp_path):
    # the H100 launch of the recipe's header: 2 groups of 4 GPUs x 4 accumulation steps (derived from the recipe's
    # global_batch_size: 8) = the seed's 8 blocks
    plan, printed = dry_run(tmp_path, "qwen27b.yaml", "fsdp2_8gpu.yaml", "Qwen__Qwen3.5-27B.derived.json",
                            "--sequence_parallel_size", "4")
    assert plan["fits"]["H100"] and plan["sequence_parallel_size"] == 4 and plan["data_parallel_size"] == 2
    assert plan["tokens_per_step"] == 8 * 32768
    assert "SP 4: 2 groups of 4 devices share each block, 8,192 tokens per device" in printed


def test_llama8b_fits_16_h100(tmp_path):
    plan, _ = dry_run(tmp_path, "llama8b.yaml", "fsdp2_2node.yaml", "meta-llama__Llama-3.1-8B.json")
    assert plan["world_size"] == 16 and plan["fits"]["H100"]
    assert plan["total_params"] == pytest.approx(8.03e9, rel=0.01)
    assert plan["tokens_per_step"] == 4 * 2 * 16 * 1024


def test_world_size_flag_overrides_the_config(tmp_path):
    plan, _ = dry_run(tmp_path, "llama8b.yaml", "fsdp2_2node.yaml", "meta-llama__Llama-3.1-8B.json", "--world_size", "32")
    assert plan["world_size"] == 32


def test_dry_run_lints_with_the_accelerate_config_and_refuses_liger_kernels(tmp_path):
    result = run_command([bin_path("python"), "scripts/sft.py", "recipes/llama8b.yaml", "--dry-run", "--config_file",
                          "accelerate_configs/fsdp2_8gpu.yaml", "--model_name_or_path",
                          str(CONFIGS / "meta-llama__Llama-3.1-8B.json"), "--activation_checkpointing", "true",
                          "--use_liger_kernel", "true"])
    assert result.returncode == 2 and "activation checkpointing is on twice" in result.stderr
    # liger-kernel is not installed: without the linter transformers' Trainer would raise ImportError at start.
    assert result.stderr.rstrip().endswith(
        "use_liger_kernel set (command line): this project does not offer Liger's Triton kernels (liger-kernel is not "
        "in its requirements and nothing here checks them, docs/kernels.md); remove use_liger_kernel -- the model's "
        "own layers run instead, and torch_compile: true fuses each decoder layer.")
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [result.stderr.rstrip().splitlines()[-1]]


def test_dry_run_refuses_a_hub_push_without_a_repo_id_and_leaves_the_token_to_the_training_machine(monkeypatch):
    """The run refused it at start (and the launch pre-check before it); the plan said the recipe was fine."""
    from sft_recipes.errors import RecipeError
    from sft_recipes.planner.dry_run import plan_dry_run

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_TOKEN_PATH", raising=False)
    recipe = str(REPO_ROOT / "recipes" / "tiny" / "llama8b.yaml")
    with pytest.raises(RecipeError, match=r"^push_to_hub: true needs hub_model_id \(e\.g\. hub_model_id: "):
        plan_dry_run(recipe, ["--push_to_hub", "true"])
    # No token here is no problem of the recipe: the machine that trains holds HF_TOKEN.
    assert "memory per GPU" in plan_dry_run(recipe, ["--push_to_hub", "true", "--hub_model_id", "my-org/tiny"])


def test_dry_run_needs_a_world_size(tmp_path):
    # A recipe whose header names no accelerate config, planned without --config_file.
    recipe = tmp_path / "bare.yaml"
    recipe.write_text("\n".join(line for line in (REPO_ROOT / "recipes" / "llama8b.yaml").read_text().splitlines()
                                 if not line.startswith("#")))
    result = run_command([bin_path("python"), "scripts/sft.py", str(recipe), "--dry-run"])
    assert result.returncode == 2 and "pass --config_file" in result.stderr
    assert f"{recipe} names no accelerate config in its header: planned without one" in result.stderr


def test_dry_run_without_config_file_takes_the_one_the_recipe_header_names(tmp_path):
    named, _ = dry_run(tmp_path, "qwen27b.yaml", "fsdp2_8gpu.yaml", "Qwen__Qwen3.5-27B.derived.json")
    plan_path = tmp_path / "plan.json"
    result = run_command([bin_path("python"), "scripts/sft.py", "recipes/qwen27b.yaml", "--dry-run", "--world_size", "8",
                          "--model_name_or_path", str(CONFIGS / "Qwen__Qwen3.5-27B.derived.json"),
                          "--plan-json", str(plan_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "using accelerate_configs/fsdp2_8gpu.yaml, the config of the launch command" in result.stderr
    # FSDP's activation checkpointing (only in the config) is planned: not the ~670 GiB per GPU without it.
    assert json.loads(plan_path.read_text())["per_device_memory_gib"] == named["per_device_memory_gib"]


def test_gptoss120b_lora_fits_8_h100(tmp_path):
    plan, _ = dry_run(tmp_path, "gptoss120b.yaml", "fsdp2_8gpu.yaml", "openai__gpt-oss-120b.derived.json")
    assert plan["fits"]["H100"] and plan["world_size"] == 8
    assert plan["total_params"] == pytest.approx(116.8e9, rel=0.01)
    assert plan["trainable_params"] < 0.01 * plan["total_params"]


def test_dry_run_refuses_a_recipe_whose_precision_differs_from_the_accelerate_config():
    # The reproduction: the 8-GPU config (bf16) with the fp32 tiny recipe trained in bf16 autocast and
    # then failed its export check; the linter now stops it before anything loads.
    result = run_command([bin_path("python"), "scripts/sft.py", "recipes/tiny/llama8b.yaml", "--dry-run",
                          "--config_file", "accelerate_configs/fsdp2_8gpu.yaml"])
    assert result.returncode == 2, result.stderr[-3000:]
    assert "mixed_precision: bf16 but the recipe says bf16: false" in result.stderr


def test_two_node_dry_run_prints_fsdp_and_hsdp_side_by_side_and_carries_them_in_the_json(tmp_path):
    plan, printed = dry_run(tmp_path, "llama8b.yaml", "fsdp2_2node.yaml", "meta-llama__Llama-3.1-8B.json",
                            "--inter_node_gbps", "200")
    assert plan["links_gbps"] == {"intra_node": 3600.0, "inter_node": 200.0} and plan["gpu"] == "H100"
    assert [layout["layout"] for layout in plan["layouts"]] == ["FSDP", "HSDP 2x8"]
    own = plan["communication"]
    assert own["layout"] == "FSDP" and own["nodes"] == 2 and own["link_seconds"]["inter-node"] > 0
    assert own["step_seconds"] == pytest.approx(own["compute_seconds"] + own["exposed_seconds"])
    assert plan["faster_layout_that_fits"] in ("FSDP", "HSDP 2x8")
    assert "network 200 Gb/s per GPU each way" in printed and "HSDP 2x8" in printed and "bound" in printed
    for suggestion in plan["suggestions"]:
        assert suggestion["fits"] and suggestion["sequences_per_step"] == plan["sequences_per_step"]


def test_dry_run_refuses_an_hsdp_shard_group_that_cannot_hold_the_run(tmp_path):
    config = tmp_path / "hsdp_2x8.yaml"
    config.write_text((REPO_ROOT / "accelerate_configs" / "fsdp2_2node.yaml").read_text() + (
        "parallelism_config:\n  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 8\n"))
    result = run_command([bin_path("python"), "scripts/sft.py", "recipes/qwen27b.yaml", "--dry-run", "--config_file",
                          str(config), "--model_name_or_path", str(CONFIGS / "Qwen__Qwen3.5-27B.derived.json"),
                          "--global_batch_size", "16", "--gpu", "H100"])  # the header names B300: 8 GPUs hold it there
    assert result.returncode == 2, result.stderr[-3000:]
    assert "HSDP shard group of 8 GPUs cannot hold this run on H100" in result.stderr
    assert re.search(r"\d+\.\d GiB per GPU, \d+\.\d GiB more than its 79\.6; the smallest shard size that fits is "
                     r"16 \(every GPU: flat FSDP", result.stderr), result.stderr[-3000:]
