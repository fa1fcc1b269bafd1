"""`scripts/sft.py RECIPE --dry-run`: the recipe + accelerate config -> a plan, in seconds, no GPU.

Maps what the launcher and the recipe say onto `plan.TrainingSetup` (world size, batch, sequence
length, precision, checkpointing, LoRA) and applies the same linter the training run applies.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch
import yaml

from sft_recipes.batching import derive_gradient_accumulation
from sft_recipes.config import Recipe
from sft_recipes.plan import Plan, TrainingSetup, load_model_config, make_plan

# What `accelerate launch` exports from a config file, for the rules that read the environment.
_LAUNCH_ENV = {
    "fsdp_activation_checkpointing": "FSDP_ACTIVATION_CHECKPOINTING",
    "fsdp_offload_params": "FSDP_OFFLOAD_PARAMS",
    "fsdp_version": "FSDP_VERSION",
}
_HEADER_CONFIG = re.compile(r"accelerate_configs/[\w.-]+\.yaml")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def read_accelerate_config(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"accelerate config not found: {path} (see accelerate_configs/).")
    return yaml.safe_load(path.read_text()) or {}


def accelerate_config_for_plan(config_file: str | None, recipe_path: str | os.PathLike) -> dict | None:
    """--config_file, else the config named in the recipe header's launch command -- said loudly either way.

    Planning without the config would drop what only the config holds (activation checkpointing,
    mixed precision): Qwen at 32k then shows ~670 GiB per GPU instead of what the launch would use.
    """
    if config_file:
        return read_accelerate_config(config_file)
    named = header_accelerate_config(recipe_path)
    if named is None:
        if Path(recipe_path).is_file():  # else load_recipe reports the missing recipe
            print(f"warning: --dry-run without --config_file and {recipe_path} names no accelerate config in its "
                  "header: planned without one (no FSDP activation checkpointing; precision from the recipe alone)",
                  file=sys.stderr)
        return None
    print(f"note: --dry-run without --config_file: using {named}, the config of the launch command in "
          f"{recipe_path}'s header (pass --config_file to plan another)", file=sys.stderr)
    return read_accelerate_config(named)


def header_accelerate_config(recipe_path: str | os.PathLike) -> Path | None:
    """The first accelerate_configs/*.yaml named in the recipe's leading comment block, found from the cwd or the recipe up."""
    recipe_path = Path(recipe_path)
    if not recipe_path.is_file():
        return None
    header = []
    for line in recipe_path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    match = _HEADER_CONFIG.search("\n".join(header))
    if match is None:
        return None
    for root in (Path.cwd(), *recipe_path.resolve().parents):
        if (root / match.group(0)).is_file():
            return root / match.group(0) if root != Path.cwd() else Path(match.group(0))
    return Path(match.group(0))  # read_accelerate_config names it as missing


def export_launch_environment(accelerate_config: dict) -> None:
    """Set the variables `accelerate launch --config_file` would, so lint sees the same run."""
    fsdp = accelerate_config.get("fsdp_config") or {}
    if accelerate_config.get("distributed_type") == "FSDP":
        os.environ["ACCELERATE_USE_FSDP"] = "true"
    for key, env in _LAUNCH_ENV.items():
        if key in fsdp:
            os.environ[env] = str(fsdp[key]).lower()
    if "mixed_precision" in accelerate_config:
        os.environ["ACCELERATE_MIXED_PRECISION"] = str(accelerate_config["mixed_precision"]).lower()


def planned_world_size(accelerate_config: dict | None, world_size: int | None) -> int:
    if world_size:
        return world_size
    if accelerate_config and accelerate_config.get("num_processes"):
        return int(accelerate_config["num_processes"])
    raise ValueError("--dry-run needs the world size: pass --config_file accelerate_configs/<config>.yaml or --world_size N.")


def training_setup(recipe: Recipe, accelerate_config: dict | None, world_size: int,
                   dataset_sequences: int | None = None) -> TrainingSetup:
    m, t = recipe.model, recipe.training
    fsdp = (accelerate_config or {}).get("fsdp_config") or {}
    mixed_precision = (accelerate_config or {}).get("mixed_precision", "bf16" if t.bf16 else "no")
    compute = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    accumulation, _ = derive_gradient_accumulation(t, world_size)
    return TrainingSetup(
        world_size=world_size,
        micro_batch_size=t.per_device_train_batch_size,
        seq_len=t.max_length,
        gradient_accumulation_steps=accumulation,
        activation_checkpointing=bool(t.activation_checkpointing or fsdp.get("fsdp_activation_checkpointing")),
        attn_implementation=m.attn_implementation or "sdpa",
        weights_dtype=DTYPES.get(m.dtype, torch.float32),
        compute_dtype=compute,
        reduce_dtype=DTYPES[t.fsdp_reduce_dtype] if mixed_precision != "no" else torch.float32,
        fp32_master_weights=mixed_precision != "no" or m.dtype == "float32",
        dataset_sequences=dataset_sequences,
    )


def plan_recipe(recipe: Recipe, accelerate_config: dict | None, world_size: int,
                dataset_sequences: int | None = None) -> Plan:
    lora = None
    if recipe.model.use_peft:
        from sft_recipes.lora import build_lora_config

        lora = build_lora_config(recipe.model)
    config = load_model_config(recipe.model.model_name_or_path)
    return make_plan(config, training_setup(recipe, accelerate_config, world_size, dataset_sequences), lora)
