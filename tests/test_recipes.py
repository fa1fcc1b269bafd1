"""Every shipped recipe and accelerate config parses against the real dataclasses (torchtune style)."""

from __future__ import annotations

import pytest
import yaml
from accelerate.commands.config.config_args import ClusterConfig

from conftest import REPO_ROOT
from sft_recipes.config import load_recipe

RECIPES = sorted((REPO_ROOT / "recipes").rglob("*.yaml"))
ACCELERATE_CONFIGS = sorted((REPO_ROOT / "accelerate_configs").glob("*.yaml"))
TWINS = sorted((REPO_ROOT / "recipes" / "tiny").glob("*.yaml"))
# What a tiny CPU twin may change: the model, the data, the sizes, and what CPU hardware forces.
TWIN_MAY_DIFFER = {
    "model_name_or_path", "dataset_name", "dataset_config", "dataset_revision", "dataset_streaming", "eval_datasets",
    "export_dtype", "max_length", "max_steps", "num_train_epochs", "learning_rate", "save_steps",
    "output_dir", "bf16", "use_cpu", "attn_implementation", "max_train_samples", "logging_steps",
    "per_device_train_batch_size", "dtype", "model_revision",
}


def rel(path):
    return path.relative_to(REPO_ROOT).as_posix()


@pytest.mark.parametrize("path", RECIPES, ids=rel)
def test_recipe_parses(path):
    # GPU recipes ask for bf16, which TrainingArguments refuses on a machine without a GPU.
    recipe = load_recipe(path, planning=True)
    assert recipe.model.model_name_or_path
    assert recipe.data.dataset_name or recipe.data.datasets
    assert recipe.training.output_dir


@pytest.mark.parametrize("path", RECIPES, ids=rel)
def test_recipe_header_gives_hardware_and_launch_command(path):
    header = path.read_text().split("\n\n")[0]
    assert header.startswith("#") and ("accelerate launch" in header or "make " in header), header


@pytest.mark.parametrize("path", RECIPES, ids=rel)
def test_activation_checkpointing_is_left_to_fsdp(path):
    # TRL turns activation_checkpointing on by default; the accelerate configs do it in FSDP instead.
    assert yaml.safe_load(path.read_text())["activation_checkpointing"] is False


@pytest.mark.parametrize("twin", TWINS, ids=rel)
def test_tiny_twin_differs_only_in_model_data_and_sizes(twin):
    real = REPO_ROOT / "recipes" / twin.name
    assert real.is_file(), f"{rel(twin)} has no real recipe {rel(real)}"
    tiny_values, real_values = yaml.safe_load(twin.read_text()), yaml.safe_load(real.read_text())
    assert set(real_values) - set(tiny_values) == set(), "the twin must set every key of the real recipe"
    assert set(tiny_values) - set(real_values) <= {"use_cpu"}
    differing = {k for k in real_values if tiny_values[k] != real_values[k]}
    assert differing <= TWIN_MAY_DIFFER, f"the twin changes more than model/data/sizes: {differing - TWIN_MAY_DIFFER}"


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=rel)
def test_accelerate_config_is_fsdp2_per_decoder_layer(path):
    config = ClusterConfig.from_yaml_file(str(path))
    fsdp = config.fsdp_config
    assert config.distributed_type.value == "FSDP"
    assert fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"  # class from the model's _no_split_modules
    assert fsdp["fsdp_reshard_after_forward"] is True
    assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"  # resume; the export gathers explicitly
    assert fsdp["fsdp_activation_checkpointing"] is True
    assert fsdp["fsdp_offload_params"] is False
    assert config.num_processes % config.num_machines == 0


def test_multinode_config_is_two_nodes_of_eight():
    config = ClusterConfig.from_yaml_file(str(REPO_ROOT / "accelerate_configs" / "fsdp2_2node.yaml"))
    assert (config.num_machines, config.num_processes, config.mixed_precision) == (2, 16, "bf16")


def test_llama_recipe_is_the_seed():
    recipe = load_recipe(REPO_ROOT / "recipes" / "llama8b.yaml", planning=True)
    m, d, t = recipe.model, recipe.data, recipe.training
    assert (m.model_name_or_path, d.dataset_name, d.dataset_format) == ("meta-llama/Llama-3.1-8B", "tatsu-lab/alpaca", "alpaca")
    assert (t.max_length, t.per_device_train_batch_size, t.gradient_accumulation_steps) == (1024, 4, 2)
    assert (t.learning_rate, t.max_grad_norm, t.max_steps, t.lr_scheduler_type.value) == (2e-5, 1.0, 100, "constant")
    assert t.optim.value.startswith("adamw") and t.bf16 and t.weight_decay == 0.01  # torch.optim.AdamW's default
    assert m.mlflow_experiment_name == "air-multinode-llama-sft" and "mlflow" in t.report_to
    assert t.output_dir.startswith("/Volumes/main/default/air_checkpoints/")
