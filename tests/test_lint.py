"""Every linter rule: one case that triggers it (with its fix in the message) and one that does not."""

from __future__ import annotations

import re

import pytest
import yaml
from transformers import PretrainedConfig

from conftest import REPO_ROOT
from sft_recipes.batching import derive_gradient_accumulation
from sft_recipes.config import RecipeError, load_recipe
from sft_recipes.lint import LintContext, lint_recipe
from sft_recipes.tiny import tiny_config

BASE = {
    "model_name_or_path": "tiny:llama", "dataset_name": "data/samples/ultrachat.jsonl", "dataset_format": "messages",
    "output_dir": "outputs/x", "use_cpu": True, "bf16": False, "activation_checkpointing": False,
    "per_device_train_batch_size": 4,
}


def recipe(tmp_path, **changes):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**BASE, **changes}))
    return load_recipe(path)


def lint(rec, world_size=1, accelerator=False, model_config=None):
    lint_recipe(rec, LintContext(world_size, accelerator, (lambda: model_config) if model_config else None))


def hybrid_config(model_type="qwen3_next"):
    config = PretrainedConfig(layer_types=["linear_attention", "full_attention"])
    config.model_type = model_type
    return config


CASES = {
    # rule: (recipe changes, lint kwargs, env, expected message fragment)
    "activation_checkpointing_twice": (
        {"activation_checkpointing": True}, {}, {"FSDP_ACTIVATION_CHECKPOINTING": "true"},
        "activation checkpointing is on twice"),
    "trl_packing_with_block_packing": (
        {"pack_blocks": True, "padding_free": True}, {}, {}, "must then be false (TRL refuses a custom collator with padding-free): set packing: false and padding_free: false, or pack_blocks: false"),
    "block_packing_needs_chat_data": (
        {"pack_blocks": True, "dataset_format": "alpaca", "dataset_name": "data/samples/alpaca.jsonl"}, {}, {},
        "(got 'alpaca'): set pack_blocks: false, or dataset_format: alpaca_chat (the rows as chat conversations)"),
    "unpacked_stream_without_max_steps": (
        {"dataset_streaming": True, "max_steps": -1, "num_train_epochs": 2, "dataset_format": "alpaca",
         "dataset_name": "data/samples/alpaca.jsonl"}, {}, {},
        "a stream read unpacked .* has no length to count them from .*: set max_steps to the steps to train, or "
        "pack_blocks: true"),
    "streamed_rows_counted_in_a_worker": (
        {"dataset_streaming": True, "dataloader_num_workers": 2, "dataset_format": "alpaca",
         "dataset_name": "data/samples/alpaca.jsonl"}, {}, {}, "set dataloader_num_workers: 0, or"),
    "packing_architecture_needs_our_fixes": (
        {"packing": True}, {"model_config": tiny_config("gpt_oss")}, {}, "use `pack_blocks: true`"),
    "hybrid_model_without_reference_kernels": (
        {"pack_blocks": True}, {"model_config": hybrid_config()}, {}, "qwen3_next has linear-attention layers"),
    "lora_dropout_with_target_parameters (ModelArguments)": (
        {"use_peft": True, "lora_target_parameters": ["mlp.experts.down_proj"], "lora_dropout": 0.05}, {}, {},
        "Set `lora_dropout: 0.0`"),
    "wrap_class_absent_from_model": (
        {"fsdp_wrap_classes": ["LlamaBlock"]}, {"model_config": tiny_config("llama")}, {},
        "are not in LlamaForCausalLM; its module classes are: .*LlamaDecoderLayer"),
    "cpu_offload_without_accelerator": (
        {}, {}, {"FSDP_OFFLOAD_PARAMS": "true"}, "set fsdp_offload_params: false on CPU"),
    "mixed_precision_differs_from_launch": (
        {}, {}, {"ACCELERATE_MIXED_PRECISION": "bf16"},
        "the accelerate config launches with mixed_precision: bf16 but the recipe says bf16: false"),
    "batch_the_world_cannot_produce": (
        {"global_batch_size": 100}, {"world_size": 16}, {}, "cannot be made on 16 processes"),
    "sequence_parallel_with_trl_packing": (
        {"sequence_parallel_size": 2, "padding_free": True}, {"world_size": 2}, {},
        "TRL's own `packing`/`padding_free` must be false: set packing: false and padding_free: false, with `pack_blocks: true`"),
    "sequence_parallel_without_block_packing": (
        {"sequence_parallel_size": 2}, {"world_size": 2}, {}, "needs `pack_blocks: true`"),
    "sequence_parallel_attention_implementation": (
        {"sequence_parallel_size": 2, "pack_blocks": True, "attn_implementation": "flex_attention"}, {"world_size": 2},
        {}, "'flex_attention' cannot take the block's example boundaries under sequence parallelism; use one of"),
    "sequence_parallel_size_not_dividing_the_world": (
        {"sequence_parallel_size": 4, "pack_blocks": True}, {"world_size": 6}, {},
        "sequence_parallel_size=4 must divide the world size 6; use one of [1, 2, 3, 6]"),
    "block_length_not_divisible_by_sequence_parallel_size": (
        {"sequence_parallel_size": 4, "pack_blocks": True, "max_length": 1002}, {"world_size": 4}, {},
        "max_length=1002 does not split into sequence_parallel_size=4 equal chunks; use a multiple of 4, e.g. 1000"),
    "sequence_parallel_size_the_heads_cannot_take": (  # tiny qwen3_5: 6 query heads / 1 kv head
        {"sequence_parallel_size": 4, "pack_blocks": True}, {"world_size": 4, "model_config": tiny_config("qwen3_5")},
        {}, "sequence_parallel_size=4 does not split this model .* Sizes that work: \\[1, 2\\]"),
    "sequence_parallel_without_global_token_count": (
        {"sequence_parallel_size": 2, "pack_blocks": True, "average_tokens_across_devices": False}, {"world_size": 2},
        {}, "leave average_tokens_across_devices at true"),
    "activation_offloading_without_accelerator": (
        {"activation_offloading": True}, {}, {}, "set activation_offloading: false on CPU"),
    "eval_strategy_without_eval_rows": (
        {"eval_strategy": "steps", "eval_steps": 10}, {}, {},
        "eval_strategy: steps evaluates, but the recipe holds out no eval rows: set test_split_size (e.g. 0.05) or "
        "eval_datasets, or eval_strategy: no"),
    "liger_kernels_we_do_not_offer": (
        {"use_liger_kernel": True}, {}, {},
        "use_liger_kernel set (recipe): this project does not offer Liger's Triton kernels (liger-kernel is not in its "
        "requirements and nothing here checks them, docs/kernels.md); remove use_liger_kernel -- the model's own "
        "layers run instead, and torch_compile: true fuses each decoder layer"),
}


@pytest.mark.parametrize("rule", CASES)
def test_rule_triggers_with_its_fix(rule, tmp_path, monkeypatch):
    changes, lint_kwargs, env, fragment = CASES[rule]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RecipeError, match=fragment if ".*" in fragment else re.escape(fragment)):
        lint(recipe(tmp_path, **changes), **lint_kwargs)


@pytest.mark.parametrize("rule", CASES)
def test_rule_stays_quiet_on_a_sound_recipe(rule, tmp_path, monkeypatch):
    for name in ("FSDP_ACTIVATION_CHECKPOINTING", "FSDP_OFFLOAD_PARAMS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # as fsdp2_cpu.yaml launches; the recipe is fp32 too
    sound = {"pack_blocks": True, "global_batch_size": 128, "fsdp_wrap_classes": ["Qwen3_5DecoderLayer"],
             "sequence_parallel_size": 2, "attn_implementation": "sdpa", "max_length": 1024,
             "eval_strategy": "steps", "eval_steps": 10, "test_split_size": 0.05}
    lint(recipe(tmp_path, **sound), world_size=16, model_config=tiny_config("qwen3_5"))  # registered hybrid: fine


def test_sequence_parallel_groups_make_the_global_batch(tmp_path):
    # 16 processes in groups of 4 read 4 streams of blocks: 128 = 4 per group x 4 groups x 8 accumulation
    lint(recipe(tmp_path, global_batch_size=128, pack_blocks=True, sequence_parallel_size=4), world_size=16)
    with pytest.raises(RecipeError, match=r"cannot be made on 16 processes: 4 per device x 4 sequence-parallel groups"):
        lint(recipe(tmp_path, global_batch_size=120, pack_blocks=True, sequence_parallel_size=4), world_size=16)


def test_activation_offloading_passes_where_there_is_an_accelerator_and_trl_fails_where_there_is_none(tmp_path):
    lint(recipe(tmp_path, activation_offloading=True), accelerator=True)
    # why the rule exists: TRL 1.16 asks torch.accelerator for the device type, which is None on this machine
    from trl.models import get_act_offloading_ctx_manager

    from sft_recipes.loading import model_class_for

    config = tiny_config("llama")
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'type'"):
        get_act_offloading_ctx_manager(model_class_for(config)._from_config(config))


def test_all_problems_are_reported_together(tmp_path, monkeypatch):
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    with pytest.raises(RecipeError) as err:
        lint(recipe(tmp_path, global_batch_size=100, pack_blocks=True, padding_free=True), world_size=16)
    assert str(err.value).count(";") >= 2


def test_bf16_rule_on_a_gpu_without_bf16(tmp_path, monkeypatch):
    rec = recipe(tmp_path, bf16=True)
    monkeypatch.setattr("torch.cuda.is_bf16_supported", lambda: False)
    lint(rec)  # no GPU here: CPU runs with use_cpu autocast bf16, and dry runs plan for other GPUs
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    with pytest.raises(RecipeError, match="this GPU has no bf16"):
        lint(rec, accelerator=True)


@pytest.mark.parametrize(("launched", "changes", "config_named"), [
    ("bf16", {}, "'no' (accelerate_configs/fsdp2_cpu.yaml)"),
    ("no", {"bf16": True}, "'bf16' (on CPU accelerate_configs/fsdp2_cpu_bf16.yaml or hsdp_cpu_bf16.yaml, on GPUs the "
                           "others)"),
])
def test_a_precision_the_launch_overrules_names_a_config_that_agrees(tmp_path, monkeypatch, launched, changes,
                                                                     config_named):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launched)
    with pytest.raises(RecipeError, match=re.escape(f"launch with an accelerate config whose mixed_precision is "
                                                    f"{config_named}, or change bf16/fp16 in the recipe")):
        lint(recipe(tmp_path, **changes))
    asked = "bf16" if changes else "no"
    for shipped in re.findall(r"\w+\.yaml", config_named):  # each config named launches what the recipe asks
        assert yaml.safe_load((REPO_ROOT / "accelerate_configs" / shipped).read_text())["mixed_precision"] == asked


def test_global_batch_and_explicit_accumulation_conflict(tmp_path):
    with pytest.raises(RecipeError, match="drop gradient_accumulation_steps"):
        lint(recipe(tmp_path, global_batch_size=128, gradient_accumulation_steps=2), world_size=16)


@pytest.mark.parametrize(("nodes", "accumulation"), [(1, 4), (2, 2), (4, 1)])
def test_global_batch_derivation_for_1_2_4_nodes(tmp_path, nodes, accumulation):
    rec = recipe(tmp_path, global_batch_size=128)  # 4 per device
    steps, derivation = derive_gradient_accumulation(rec.training, world_size=8 * nodes)
    assert steps == accumulation
    assert derivation == (f"global batch 128 sequences = 4 per device x {8 * nodes} processes "
                          f"x {accumulation} accumulation steps (derived)")


def test_global_batch_derivation_counts_sequence_parallel_groups(tmp_path):
    rec = recipe(tmp_path, global_batch_size=16, per_device_train_batch_size=1, sequence_parallel_size=4)
    steps, derivation = derive_gradient_accumulation(rec.training, world_size=16)  # 4 groups share 16 ranks
    assert steps == 4
    assert derivation == ("global batch 16 sequences = 1 per device x 4 sequence-parallel groups (16 processes / "
                          "sequence_parallel_size 4) x 4 accumulation steps (derived)")
    with pytest.raises(ValueError, match="sequence_parallel_size=3 must be a positive divisor of the world size 16"):
        derive_gradient_accumulation(recipe(tmp_path, sequence_parallel_size=3).training, world_size=16)


def test_global_batch_in_tokens(tmp_path):
    rec = recipe(tmp_path, global_batch_tokens=8 * 32768, max_length=32768, per_device_train_batch_size=1)
    assert derive_gradient_accumulation(rec.training, world_size=8)[0] == 1
    assert derive_gradient_accumulation(rec.training, world_size=2)[0] == 4
    with pytest.raises(ValueError, match="not a whole number of max_length=32768-token sequences"):
        derive_gradient_accumulation(recipe(tmp_path, global_batch_tokens=1000, max_length=32768).training, 8)


def test_recipe_precision_must_match_the_launch_in_both_directions(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    lint(recipe(tmp_path, bf16=True))  # fsdp2_8gpu.yaml with a GPU recipe
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    with pytest.raises(RecipeError, match="launches with mixed_precision: no but the recipe says bf16: true"):
        lint(recipe(tmp_path, bf16=True))
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    lint(recipe(tmp_path, bf16=True))  # plain `python scripts/sft.py`: no launcher to disagree with
