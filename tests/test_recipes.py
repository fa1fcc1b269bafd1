"""Every shipped recipe and accelerate config parses against the real dataclasses (torchtune style)."""

from __future__ import annotations

import pytest
import yaml
from accelerate.commands.config.config_args import ClusterConfig

from conftest import REPO_ROOT
from sft_recipes.batching import derive_gradient_accumulation
from sft_recipes.config import load_recipe

RECIPES = sorted((REPO_ROOT / "recipes").rglob("*.yaml"))
ONE_PROCESS_CONFIG = REPO_ROOT / "accelerate_configs" / "cpu_1process.yaml"  # train() in a plain Python session
ACCELERATE_CONFIGS = sorted(set((REPO_ROOT / "accelerate_configs").glob("*.yaml")) - {ONE_PROCESS_CONFIG})
TWINS = sorted((REPO_ROOT / "recipes" / "tiny").glob("*.yaml"))
# What a tiny CPU twin may change: the model, the data, the sizes, and what CPU hardware forces.
# The twins' sample data has no held-out split, so a twin may leave out its big recipe's eval (exercised on CPU by
# tests/test_eval_loss.py and `make demo`); it keeps every other key but model, data and sizes.
# The real recipes state their global batch (it must survive SP, HSDP and node counts on GPUs); the twins fix
# gradient_accumulation_steps instead, because the tests launch them on 1, 2 and 4 CPU processes and compare
# layouts at batches they choose per test: a twin may give the real recipe's global batch key as accumulation.
TWIN_BATCH = ({"global_batch_size", "global_batch_tokens"}, "gradient_accumulation_steps")
# mlflow_experiment_name: a twin's CPU runs must not land among the real recipe's GPU runs in its experiment.
TWIN_MAY_DIFFER = {
    "mlflow_experiment_name",
    "eval_datasets", "eval_strategy", "eval_steps", "per_device_eval_batch_size",
    "model_name_or_path", "dataset_name", "dataset_config", "dataset_revision", "dataset_streaming",
    "export_dtype", "max_length", "max_steps", "num_train_epochs", "learning_rate", "save_steps",
    "output_dir", "bf16", "use_cpu", "attn_implementation", "max_train_samples", "logging_steps",
    "per_device_train_batch_size", "dtype", "model_revision", "max_pixels",
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
    real_batch = TWIN_BATCH[0] & set(real_values)
    assert real_batch, f"{rel(real)} must state its global batch (global_batch_size or global_batch_tokens)"
    assert TWIN_BATCH[1] not in real_values, "a real recipe's accumulation is derived from its global batch"
    assert TWIN_BATCH[1] in tiny_values
    real_values = {k: v for k, v in real_values.items() if k not in real_batch}
    tiny_values = {k: v for k, v in tiny_values.items() if k != TWIN_BATCH[1]}
    assert set(real_values) - set(tiny_values) == set(), "the twin must set every key of the real recipe"
    assert set(tiny_values) - set(real_values) <= {"use_cpu"}
    if "mlflow_experiment_name" in real_values:
        assert tiny_values["mlflow_experiment_name"] != real_values["mlflow_experiment_name"]
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


def test_one_process_config_is_one_cpu_process_without_fsdp():
    config = ClusterConfig.from_yaml_file(str(ONE_PROCESS_CONFIG))
    assert (config.distributed_type.value, config.num_processes, config.num_machines, config.use_cpu) == (
        "NO", 1, 1, True)


def test_multinode_config_is_two_nodes_of_eight():
    config = ClusterConfig.from_yaml_file(str(REPO_ROOT / "accelerate_configs" / "fsdp2_2node.yaml"))
    assert (config.num_machines, config.num_processes, config.mixed_precision) == (2, 16, "bf16")


def test_llama_recipe_is_the_seed():
    recipe = load_recipe(REPO_ROOT / "recipes" / "llama8b.yaml", planning=True)
    m, d, t = recipe.model, recipe.data, recipe.training
    assert (m.model_name_or_path, d.dataset_name, d.dataset_format) == ("meta-llama/Llama-3.1-8B", "tatsu-lab/alpaca", "alpaca")
    assert (t.max_length, t.per_device_train_batch_size, t.global_batch_size) == (1024, 4, 128)
    assert derive_gradient_accumulation(t, 16)[0] == 2  # the seed's accumulation on its 16 ranks
    assert (t.learning_rate, t.max_grad_norm, t.max_steps, t.lr_scheduler_type.value) == (2e-5, 1.0, 100, "constant")
    assert t.optim.value.startswith("adamw") and t.bf16 and t.weight_decay == 0.01  # torch.optim.AdamW's default
    assert m.mlflow_experiment_name == "air-multinode-llama-sft" and "mlflow" in t.report_to
    assert t.output_dir.startswith("/Volumes/main/default/air_checkpoints/")


# What each seed (shared/seeds/) sets, in recipe keys: its explicit arguments and the defaults its code relies on.
SEED_VALUES = {
    "llama8b.yaml": {  # 000: torch.optim.AdamW(lr), FSDP1 MixedPrecision(bf16 params/reduce), saves once at the end
        "max_length": 1024, "per_device_train_batch_size": 4, "global_batch_size": 4 * 2 * 16,  # x 2 accum. x 16 ranks
        "learning_rate": 2e-5, "max_steps": 100, "optim": "adamw_torch", "weight_decay": 0.01,
        "lr_scheduler_type": "constant", "max_grad_norm": 1.0, "dtype": "bfloat16", "fsdp_reduce_dtype": "bfloat16",
        "save_strategy": "no", "seed": 0,
    },
    "qwen27b.yaml": {  # 001: AdamW(lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0, fused=True), no clipping, no saves
        "max_length": 32768, "per_device_train_batch_size": 1, "global_batch_size": 1 * 1 * 8,  # x 1 accum. x 8 GPUs
        "learning_rate": 1e-5, "adam_beta1": 0.9, "adam_beta2": 0.95, "weight_decay": 0.0, "optim": "adamw_torch_fused",
        "lr_scheduler_type": "constant", "max_grad_norm": 0.0, "dtype": "bfloat16", "fsdp_reduce_dtype": "float32",
        "dataloader_num_workers": 1, "save_strategy": "no", "logging_steps": 100, "seed": 0,
    },
    "gptoss120b.yaml": {  # 003: its SFTConfig and LoraConfig; accelerate's default FSDP2 policy reduces in bf16
        "max_length": 2048, "per_device_train_batch_size": 1, "global_batch_size": 1 * 4 * 8,  # x 4 accum. x 8 GPUs
        "learning_rate": 1.5e-4, "num_train_epochs": 1, "lr_scheduler_type": "cosine", "warmup_steps": 0.03,
        "bf16": True, "logging_steps": 5, "save_strategy": "no", "lora_r": 32, "lora_alpha": 32, "lora_dropout": 0.0,
        "fsdp_reduce_dtype": "bfloat16",
    },
}


@pytest.mark.parametrize("name", SEED_VALUES)
def test_recipe_header_names_every_key_that_differs_from_its_seed(name):
    path = REPO_ROOT / "recipes" / name
    recipe = load_recipe(path, planning=True)
    header = path.read_text().split("\n\n")[0]
    differing = []
    for key, seed_value in SEED_VALUES[name].items():
        parsed = next(getattr(part, key) for part in (recipe.data, recipe.model, recipe.training) if hasattr(part, key))
        if getattr(parsed, "value", parsed) != seed_value:
            differing.append(key)
    assert differing, "the recipes differ from their seeds on purpose; an empty list means this test lost track"
    assert [key for key in differing if f"{key}:" not in header] == [], f"{name}: say why in the header"


# (recipe, world size, sequence_parallel_size, derived accumulation): the layouts the headers offer.
STATED_BATCH_LAYOUTS = [
    ("llama8b.yaml", 16, 1, 2), ("llama8b.yaml", 8, 1, 4), ("llama8b.yaml", 32, 1, 1),
    ("qwen27b.yaml", 8, 1, 1), ("qwen27b.yaml", 8, 2, 2), ("qwen27b.yaml", 8, 4, 4), ("qwen27b.yaml", 16, 4, 2),
    ("gptoss120b.yaml", 8, 1, 4), ("gptoss120b.yaml", 16, 1, 2),
]


@pytest.mark.parametrize(("name", "world_size", "sp", "accumulation"), STATED_BATCH_LAYOUTS)
def test_real_recipes_keep_their_global_batch_on_every_offered_layout(name, world_size, sp, accumulation):
    from sft_recipes.lint import LintContext, batch_the_world_cannot_produce

    recipe = load_recipe(REPO_ROOT / "recipes" / name, {"sequence_parallel_size": sp}, planning=True)
    assert batch_the_world_cannot_produce(recipe, LintContext(world_size, False)) is None
    assert derive_gradient_accumulation(recipe.training, world_size)[0] == accumulation
    stated = recipe.training.global_batch_size
    assert recipe.training.per_device_train_batch_size * world_size // sp * accumulation == stated


def test_a_launch_that_would_change_the_stated_global_batch_is_refused_naming_the_fix():
    # README's H100 layout for qwen27b with the accumulation the header used to give: 4 blocks, not 8.
    from sft_recipes.lint import LintContext, batch_the_world_cannot_produce

    recipe = load_recipe(REPO_ROOT / "recipes" / "qwen27b.yaml",
                         ["--sequence_parallel_size", "4", "--gradient_accumulation_steps", "2"], planning=True)
    assert batch_the_world_cannot_produce(recipe, LintContext(8, False)) == (
        "global_batch_size: 8 (recipe) and gradient_accumulation_steps: 2 (command line) are both set, and a fixed "
        "accumulation would change the global batch on another layout; drop gradient_accumulation_steps (it is "
        "derived from the global batch and the world size), or pass --global_batch_size N to train another global "
        "batch")
    llama = load_recipe(REPO_ROOT / "recipes" / "llama8b.yaml", planning=True)  # 128 sequences, 4 per device
    problem = batch_the_world_cannot_produce(llama, LintContext(24, False))
    assert problem.startswith("The global batch of 128 sequences cannot be made on 24 processes") and \
        "Change per_device_train_batch_size, the number of processes, or the global batch" in problem
