"""The planner's communication model and layout search: bytes per GPU per step by hand, the bound
under the stated link table, FSDP against HSDP, one node without a network term, what to change."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sft_recipes.config import load_recipe
from sft_recipes.loading import read_model_config
from sft_recipes.launch import read_accelerate_config
from sft_recipes.planner.communication import LINKS_GBPS, Links, MeshLayout, estimate_communication
from sft_recipes.planner.layouts import compare_layouts, layout_report, shard_group_shortfall
from sft_recipes.planner.model_math import count_parameters
from sft_recipes.planner.report import format_layouts, plan_recipe
from sft_recipes.planner.setup import TrainingSetup
from sft_recipes.tiny import REALWORLD_DIR

from conftest import REPO_ROOT

CONFIGS = REALWORLD_DIR / "model_configs"
LLAMA_8B = CONFIGS / "meta-llama__Llama-3.1-8B.json"
QWEN_27B = CONFIGS / "Qwen__Qwen3.5-27B.derived.json"

# Llama-3.1-8B, counted by hand from its config: hidden 4096, 32 layers, 32 heads / 8 kv heads of 128,
# MLP 14336, vocabulary 128256, untied head.
EMBEDDING = 128256 * 4096  # = the LM head
LAYER = (4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096) + 3 * 4096 * 14336 + 2 * 4096  # attention + MLP + 2 norms
ROOT = 2 * EMBEDDING + 4096  # embedding, LM head, final norm
TOTAL = 32 * LAYER + ROOT


@pytest.fixture(scope="module")
def llama():
    config = read_model_config(LLAMA_8B, download=False)
    return config, count_parameters(config)


def llama_recipe_setup(world_size: int, **changes) -> TrainingSetup:
    """recipes/llama8b.yaml as accelerate_configs/fsdp2_2node.yaml launches it: 4 x 1024, bf16 compute, fp32 reduce."""
    setup = TrainingSetup(world_size=world_size, micro_batch_size=4, seq_len=1024, gradient_accumulation_steps=2,
                          reduce_dtype=torch.float32)
    return dataclasses.replace(setup, **changes)


def test_llama_8b_bytes_per_step_per_gpu_equal_hand_arithmetic(llama):
    config, counts = llama
    assert (counts.total, counts.root, counts.decoder_layers[0]) == (TOTAL, ROOT, LAYER) == (8030261248, 1050677248, 218112000)
    setup = llama_recipe_setup(16)

    flat = estimate_communication(config, counts, setup, MeshLayout(2, 8, 1), "H100")
    # per micro-batch (2 of them): every layer gathered in forward and again in backward, the root once, in bf16;
    # a ring over 16 ranks brings 15/16 of each to every rank. Gradients: reduce-scattered in fp32
    # after each micro-batch too (sync_each_batch keeps them sharded), not once per step.
    assert flat.all_gather_bytes == pytest.approx(2 * (2 * 32 * LAYER + ROOT) * 2 * 15 / 16)
    assert flat.reduce_scatter_bytes == pytest.approx(2 * TOTAL * 4 * 15 / 16)
    assert flat.all_reduce_bytes == 0 and flat.all_to_all_bytes == 0

    hsdp = estimate_communication(config, counts, dataclasses.replace(setup, replicate_size=2), MeshLayout(2, 8, 2), "H100")
    # shard over the 8 GPUs of a node, reduce-scattered there after each micro-batch; then the fp32 gradient
    # shard (1/8, the sum of both micro-batches) all-reduced by the 2 replicas once per step: 2 x 1/2 of it
    assert hsdp.all_gather_bytes == pytest.approx(2 * (2 * 32 * LAYER + ROOT) * 2 * 7 / 8)
    assert hsdp.reduce_scatter_bytes == pytest.approx(2 * TOTAL * 4 * 7 / 8)
    assert hsdp.all_reduce_bytes == pytest.approx(2 * (1 / 2) * TOTAL * 4 / 8)


def test_lora_gathers_the_frozen_base_and_reduces_only_the_adapter():
    from peft import LoraConfig

    from sft_recipes.tiny import tiny_config

    config = tiny_config("llama")
    counts = count_parameters(config, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    setup = TrainingSetup(world_size=4, micro_batch_size=1, seq_len=64, reduce_dtype=torch.float32)
    estimate = estimate_communication(config, counts, setup, MeshLayout(1, 4, 1), "H100")
    layered = counts.total - counts.root
    assert estimate.all_gather_bytes == pytest.approx((2 * layered + counts.root) * 2 * 3 / 4)
    assert estimate.reduce_scatter_bytes == pytest.approx(counts.trainable * 4 * 3 / 4)
    assert counts.trainable < counts.total / 10


def test_the_2x8_h100_llama_recipe_is_compute_bound_under_the_link_table_and_network_bound_on_a_slow_network(llama):
    config, counts = llama
    assert LINKS_GBPS["H100"] == (3600.0, 400.0)  # the table the bound below is stated for
    setup = llama_recipe_setup(16)

    stated = estimate_communication(config, counts, setup, MeshLayout(2, 8, 1), "H100")
    assert stated.bound == "compute"
    assert stated.link_seconds["inter-node"] > stated.link_seconds["intra-node"] > 0
    assert 0 < stated.exposed_seconds < 0.1 * stated.compute_seconds

    slow = estimate_communication(config, counts, setup, MeshLayout(2, 8, 1), "H100", Links.for_gpu("H100", None, 50))
    assert slow.bound == "inter-node" and slow.exposed_seconds > stated.exposed_seconds
    assert slow.step_seconds == pytest.approx(slow.compute_seconds + slow.exposed_seconds)


def test_at_8_nodes_hsdp_beats_flat_fsdp(llama):
    # the seed's precision (accelerate's default bf16 reduce), 1 x 1024 per GPU, 2 accumulation steps: flat FSDP
    # gathers every layer over the network on every micro-batch; HSDP over NVLink, one all-reduce per step
    config, counts = llama
    setup = llama_recipe_setup(64, micro_batch_size=1, reduce_dtype=torch.bfloat16)
    flat, hsdp = compare_layouts(config, counts, setup, 8, "H100", Links.for_gpu("H100"))

    assert (flat.layout.name, hsdp.layout.name) == ("FSDP", "HSDP 8x8")
    assert hsdp.step_seconds < flat.step_seconds
    assert hsdp.communication.link_seconds["inter-node"] < flat.communication.link_seconds["inter-node"]
    assert hsdp.memory_gib > flat.memory_gib  # state sharded over 8 GPUs, not 64


def test_one_node_has_no_inter_node_term_and_nothing_to_compare(llama):
    config, counts = llama
    setup = llama_recipe_setup(8)
    [only] = compare_layouts(config, counts, setup, 1, "H100", Links.for_gpu("H100"))
    assert only.layout.name == "FSDP" and only.communication.link_seconds["inter-node"] == 0
    assert only.communication.link_seconds["intra-node"] > 0 and only.communication.bound != "inter-node"
    report = layout_report(config, counts, setup, 1, "H100", Links.for_gpu("H100"))
    assert "no inter-node term" in format_layouts(report, "accelerate launch ...")
    assert report.to_dict()["faster_layout_that_fits"] is None


def recipe_report(recipe: str, model, config_file: str, world_size: int, nodes: int, **overrides):
    loaded = load_recipe(REPO_ROOT / "recipes" / recipe, {"model_name_or_path": str(model), **overrides}, planning=True)
    accelerate_config = read_accelerate_config(REPO_ROOT / "accelerate_configs" / config_file)
    plan = plan_recipe(loaded, accelerate_config, world_size)
    config = read_model_config(model, download=False)
    return plan, layout_report(config, plan.counts, plan.setup, nodes, "H100", Links.for_gpu("H100"),
                               f"accelerate_configs/{config_file}")


def test_qwen27b_at_32k_on_8_h100_gets_a_suggestion_that_fits_and_keeps_8_blocks_per_step():
    plan, report = recipe_report("qwen27b.yaml", QWEN_27B, "fsdp2_8gpu.yaml", 8, 1)
    assert not plan.fits["H100"] and report.suggestions
    for option in report.suggestions:
        s = option.setup
        assert option.fits("H100") and s.seq_len == 32768
        assert s.micro_batch_size * s.gradient_accumulation_steps * s.data_parallel_size == 8
    best = report.suggestions[0]
    text = format_layouts(report, ".venv/bin/accelerate launch --config_file accelerate_configs/fsdp2_8gpu.yaml scripts/sft.py "
                                  "recipes/qwen27b.yaml")
    assert f"scripts/sft.py recipes/qwen27b.yaml {' '.join(best.overrides)}" in text
    assert "does not fit on H100" in text
    # every suggested flag is a recipe key scripts/sft.py takes
    replanned = load_recipe(REPO_ROOT / "recipes" / "qwen27b.yaml",
                            ["--model_name_or_path", str(QWEN_27B), *best.overrides], planning=True)
    again = plan_recipe(replanned, read_accelerate_config(REPO_ROOT / "accelerate_configs" / "fsdp2_8gpu.yaml"), 8)
    assert again.fits["H100"] and again.sequences_per_step == 8 and again.setup.seq_len == 32768


def test_llama8b_on_16_h100_is_told_only_to_stop_checkpointing():
    # The model disagrees with "none": with checkpointing on, no layout is 5% faster (communication is hidden
    # behind compute at 4 x 1024 per GPU); without it the step does 6 instead of 8 FLOPs per parameter and
    # token, and 8 x 1024 uncheckpointed tokens still fit an H100. That is a config change, named as such.
    plan, report = recipe_report("llama8b.yaml", LLAMA_8B, "fsdp2_2node.yaml", 16, 2)
    assert plan.fits["H100"] and report.suggestions
    assert all(not o.setup.activation_checkpointing for o in report.suggestions)
    assert all("fsdp_activation_checkpointing: false" in o.accelerate_config for o in report.suggestions)
    assert report.layout_to_launch().layout == report.own.layout  # FSDP and HSDP 2x8 within 5%: keep the launch's


def test_an_hsdp_shard_group_that_cannot_hold_the_run_names_the_shortfall_and_the_smallest_shard_that_fits():
    loaded = load_recipe(REPO_ROOT / "recipes" / "qwen27b.yaml", {"model_name_or_path": str(QWEN_27B),
                                                                 "global_batch_size": 16}, planning=True)
    accelerate_config = read_accelerate_config(REPO_ROOT / "accelerate_configs" / "fsdp2_2node.yaml")
    plan = plan_recipe(loaded, accelerate_config, 16, replicate_size=2)  # 16 blocks: one per process
    config = read_model_config(QWEN_27B, download=False)

    shortfall = shard_group_shortfall(config, plan.counts, plan.setup, "H100")
    assert shortfall is not None and shortfall.smallest_fitting_shard == 16
    assert shortfall.shortfall_gib == pytest.approx(plan.memory.total - 79.6)
    assert shard_group_shortfall(config, plan.counts, plan.setup, "B300") is None


def test_the_dry_run_plans_for_the_gpu_the_recipe_header_names(tmp_path):
    from sft_recipes.planner.setup import header_gpu

    assert (header_gpu(REPO_ROOT / "recipes" / "qwen27b.yaml"), header_gpu(REPO_ROOT / "recipes" / "llama8b.yaml")) == \
        ("B300", "H100")
    bare = tmp_path / "bare.yaml"
    bare.write_text("model_name_or_path: x\n")
    assert header_gpu(bare) == "H100"


def test_a_layout_change_names_the_config_to_launch_with():
    from sft_recipes.planner.layouts import hsdp_config_name

    # back to flat FSDP from an HSDP launch: the shipped flat config of that many nodes, else the base without it
    assert hsdp_config_name(MeshLayout(2, 8, 1), "/tmp/mine.yaml") == "accelerate_configs/fsdp2_2node.yaml"
    assert hsdp_config_name(MeshLayout(3, 8, 1), "/tmp/mine.yaml") == "a copy of /tmp/mine.yaml without parallelism_config"
    assert hsdp_config_name(MeshLayout(3, 8, 3), "accelerate_configs/fsdp2_2node.yaml") == (
        "a copy of accelerate_configs/fsdp2_2node.yaml with parallelism_config: "
        "{parallelism_config_dp_replicate_size: 3, parallelism_config_dp_shard_size: 8}")


def test_a_suggested_launch_runs_on_the_config_it_needs():
    from sft_recipes.planner.report import suggested_launch

    command = ".venv/bin/accelerate launch --config_file accelerate_configs/fsdp2_2node.yaml scripts/sft.py recipes/llama8b.yaml"
    assert suggested_launch(command, ("--max_length", "4096"), None) == [f"{command} --max_length 4096"]
    assert suggested_launch(command, (), "accelerate_configs/hsdp_2node.yaml") == [
        command.replace("fsdp2_2node.yaml", "hsdp_2node.yaml")]
    edited = "a copy of accelerate_configs/fsdp2_2node.yaml with fsdp_activation_checkpointing: false"
    assert suggested_launch(command, ("--per_device_train_batch_size", "2"), edited) == [
        command.replace("accelerate_configs/fsdp2_2node.yaml", "my_accelerate_config.yaml")
        + " --per_device_train_batch_size 2",
        f"my_accelerate_config.yaml: {edited}"]  # never the old config beside "a copy of" it


@pytest.mark.parametrize("recipe, model, sizes", [
    ("qwen27b.yaml", QWEN_27B, [1, 2, 4, 8]),  # packed blocks; the heads split 2, 4 or 8 ways
    ("qwen27b-vision.yaml", QWEN_27B, [1]),  # image data: sequence parallelism refused
    ("llama8b.yaml", LLAMA_8B, [1]),  # unpacked rows (no pack_blocks): refused
])
def test_the_sequence_parallel_sizes_a_recipe_takes_are_those_its_run_would_launch_with(recipe, model, sizes):
    from sft_recipes.lint import LintContext, sequence_parallel_sizes_the_recipe_takes

    loaded = load_recipe(REPO_ROOT / "recipes" / recipe, {"model_name_or_path": str(model)}, planning=True)
    config = read_model_config(model, download=False)
    assert sequence_parallel_sizes_the_recipe_takes(loaded, LintContext(16, True, lambda: config), list(range(1, 9))) \
        == sizes


def test_no_suggestion_is_a_sequence_parallel_size_the_run_refuses():
    from sft_recipes.planner.dry_run import plan_layouts

    loaded = load_recipe(REPO_ROOT / "recipes" / "qwen27b-vision.yaml", {"model_name_or_path": str(QWEN_27B),
                                                                          "global_batch_size": 16}, planning=True)
    accelerate_config = read_accelerate_config(REPO_ROOT / "accelerate_configs" / "hsdp_2node.yaml")
    plan = plan_recipe(loaded, accelerate_config, 16, replicate_size=2)
    # Unfiltered, SP 2 is among the fastest layouts that fit 2 x 8 B300 (the control) ...
    unfiltered = layout_report(read_model_config(QWEN_27B, download=False), plan.counts, plan.setup, 2, "B300",
                               Links.for_gpu("B300"), "accelerate_configs/hsdp_2node.yaml", "global_batch_size")
    assert any(o.setup.sequence_parallel_size > 1 for o in unfiltered.suggestions)
    # ... but this run refuses SP on image data, so the dry run suggests none.
    report = plan_layouts(loaded, plan, accelerate_config, "accelerate_configs/hsdp_2node.yaml", 2, "B300", None, None)
    assert report.suggestions and all(o.setup.sequence_parallel_size == 1 for o in report.suggestions)
