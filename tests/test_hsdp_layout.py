"""HSDP without a launch: the shipped configs, what the linter refuses, and the mesh check on a real FSDP2 model."""

from __future__ import annotations

import re

import pytest
import torch
import yaml
from accelerate.commands.config.config_args import ClusterConfig

from conftest import REALWORLD, REPO_ROOT, bin_path, run_command
from sft_recipes.config import RecipeError, load_recipe
from sft_recipes.hsdp import DataParallelMesh, launched_mesh, model_mesh_problem
from sft_recipes.launch import AccelerateConfig, read_accelerate_config
from sft_recipes.lint import LintContext, lint_recipe

CONFIGS = REPO_ROOT / "accelerate_configs"
# (config, machines, processes, replicas, shards): shards = processes per machine, so every all-gather stays in a node.
HSDP_CONFIGS = [("hsdp_cpu.yaml", 1, 4, 2, 2), ("hsdp_2node.yaml", 2, 16, 2, 8), ("hsdp_4node.yaml", 4, 32, 4, 8)]
ENV_KEYS = ("ACCELERATE_USE_PARALLELISM_CONFIG", *(f"PARALLELISM_CONFIG_{name}_SIZE"
                                                   for name in ("DP_REPLICATE", "DP_SHARD", "TP", "CP", "SP")))


@pytest.fixture(autouse=True)
def no_launch_environment(monkeypatch):
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)


def launched_with(monkeypatch, **sizes):
    """The environment `accelerate launch` makes from a config whose parallelism_config has `sizes`."""
    config = AccelerateConfig({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}, "parallelism_config": {
        f"parallelism_config_{name}_size": size for name, size in sizes.items()}})
    for key, value in config.launch_environment().items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("name, machines, processes, replicas, shards", HSDP_CONFIGS)
def test_shipped_hsdp_configs_make_a_mesh_of_every_process(name, machines, processes, replicas, shards, monkeypatch):
    config = ClusterConfig.from_yaml_file(str(CONFIGS / name))
    assert (config.num_machines, config.num_processes) == (machines, processes)
    assert config.parallelism_config == {"parallelism_config_dp_replicate_size": replicas,
                                         "parallelism_config_dp_shard_size": shards}
    assert shards == processes // machines or machines == 1
    # ...and the environment `accelerate launch` exports for it, read back as the run reads it.
    assert read_accelerate_config(CONFIGS / name).problems() == []
    for key, value in read_accelerate_config(CONFIGS / name).launch_environment().items():
        monkeypatch.setenv(key, value)
    assert launched_mesh(processes) == DataParallelMesh(replicas, shards)
    header = (CONFIGS / name).read_text().split("\ncompute_environment")[0]
    assert f"accelerate_configs/{name}" in header and "Differences from" in header


def test_a_config_without_parallelism_config_is_flat_fsdp():
    assert "ACCELERATE_USE_PARALLELISM_CONFIG" not in read_accelerate_config(CONFIGS / "fsdp2_2node.yaml").launch_environment()
    assert launched_mesh(16) == DataParallelMesh(1, 16)
    assert launched_mesh(16).describe() == "FSDP 1 x 16 (flat) over 16 processes"
    assert DataParallelMesh(2, 8).describe() == "HSDP 2 replicas x 8 shards (dp_replicate x dp_shard) over 16 processes"


def recipe(tmp_path, **changes):
    values = {"model_name_or_path": "tiny:llama", "dataset_name": "data/samples/ultrachat.jsonl",
              "dataset_format": "messages", "output_dir": "outputs/x", "use_cpu": True, "bf16": False,
              "activation_checkpointing": False, "per_device_train_batch_size": 4, **changes}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(values))
    return load_recipe(path)


def lint(rec, world_size):
    lint_recipe(rec, LintContext(world_size, False))


def test_a_replicate_times_shard_product_that_is_not_the_world_size_names_every_factor(tmp_path, monkeypatch):
    launched_with(monkeypatch, dp_replicate=2, dp_shard=8)
    lint(recipe(tmp_path), world_size=16)
    with pytest.raises(RecipeError) as err:
        lint(recipe(tmp_path), world_size=8)
    assert ("the accelerate config's parallelism_config makes dp_replicate 2 x dp_shard 8 = 16 processes, but the launch "
            "has 8 (num_processes); set parallelism_config_dp_replicate_size x parallelism_config_dp_shard_size to 8 "
            "(one of 1 x 8, 2 x 4, 4 x 2: replicas = nodes, shards = GPUs per node), or launch on 16 processes"
            ) in str(err.value)


@pytest.mark.parametrize(("launched", "world_size", "named"), [
    ("bf16", 32, " -- as accelerate_configs/hsdp_4node.yaml (4 x 8) does"),
    ("bf16", 4, " -- as accelerate_configs/hsdp_cpu_bf16.yaml (2 x 2) does"),
    ("no", 4, " -- as accelerate_configs/hsdp_cpu.yaml (2 x 2) does"),
    ("no", 32, ""),  # no fp32 config of 32 processes is shipped: a bf16 one would be refused for its precision
])
def test_a_world_size_a_shipped_hsdp_config_fits_names_that_config(tmp_path, monkeypatch, launched, world_size, named):
    launched_with(monkeypatch, dp_replicate=2, dp_shard=8)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launched)
    with pytest.raises(RecipeError) as err:
        lint(recipe(tmp_path, bf16=launched == "bf16"), world_size=world_size)
    assert f"replicas = nodes, shards = GPUs per node){named}, or launch on 16 processes" in str(err.value)


def test_tensor_context_and_deepspeed_sequence_parallel_sizes_are_refused(tmp_path, monkeypatch):
    launched_with(monkeypatch, dp_replicate=2, dp_shard=2, tp=2, cp=2)
    with pytest.raises(RecipeError) as err:
        lint(recipe(tmp_path), world_size=16)
    message = str(err.value)
    assert ("sets parallelism_config_tp_size: 2, parallelism_config_cp_size: 2: tensor, context and DeepSpeed sequence "
            "parallelism are not run by these recipes; set them to 1") in message
    assert "makes dp_replicate 2 x dp_shard 2 x tp 2 x cp 2 = 16 processes" not in message  # 16 = 16: no mismatch


def test_replicas_without_a_shard_are_refused(tmp_path, monkeypatch):
    launched_with(monkeypatch, dp_replicate=4, dp_shard=1)
    with pytest.raises(RecipeError, match=re.escape("with parallelism_config_dp_shard_size 1 is plain data parallelism")):
        lint(recipe(tmp_path), world_size=4)


def test_our_sequence_parallelism_with_hsdp_is_refused_naming_what_works(tmp_path, monkeypatch):
    sp = {"sequence_parallel_size": 2, "pack_blocks": True, "global_batch_size": 32, "max_length": 1024}
    launched_with(monkeypatch, dp_replicate=1, dp_shard=16)  # one replica: flat FSDP, SP composes
    lint(recipe(tmp_path, **sp), world_size=16)
    launched_with(monkeypatch, dp_replicate=2, dp_shard=8)
    with pytest.raises(RecipeError, match=re.escape(
            "sequence_parallel_size 2 with HSDP (parallelism_config_dp_replicate_size 2) is not supported; use HSDP "
            "with sequence_parallel_size: 1, or sequence parallelism with flat FSDP (an accelerate config without "
            "parallelism_config, e.g. accelerate_configs/fsdp2_2node.yaml)")):
        lint(recipe(tmp_path, **sp), world_size=16)


def test_dry_run_of_the_llama_recipe_on_hsdp_and_on_a_world_it_does_not_fit():
    llama = str(REALWORLD / "model_configs" / "meta-llama__Llama-3.1-8B.json")
    command = [bin_path("python"), "scripts/sft.py", "recipes/llama8b.yaml", "--dry-run", "--config_file",
               "accelerate_configs/hsdp_2node.yaml", "--model_name_or_path", llama]
    assert run_command(command).returncode == 0
    refused = run_command([*command, "--world_size", "24"])
    assert refused.returncode == 2
    assert "makes dp_replicate 2 x dp_shard 8 = 16 processes, but the launch has 24" in refused.stderr


def test_the_mesh_check_refuses_a_model_not_laid_out_as_launched(single_rank_group):
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model)  # flat FSDP2 over the one process: a 1-D mesh, placed (Shard(0),)
    assert model_mesh_problem(model, DataParallelMesh(1, 1)) is None
    assert model_mesh_problem(model, DataParallelMesh(2, 2)) == (
        "parameter 0.weight lies on a mesh of shape (1,) placed (Shard(dim=0),), not (2, 2) placed "
        "(Replicate(), Shard(dim=0))")
    plain = torch.nn.Linear(4, 4)
    assert model_mesh_problem(plain, DataParallelMesh(1, 1)) == "no parameter of the model is sharded (all are plain tensors)"
