"""sft_recipes.launch: the launch layout of the shipped accelerate configs, checked against accelerate's own launcher."""

from __future__ import annotations

import pytest
import yaml
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_multi_gpu_env

from conftest import REPO_ROOT
from sft_recipes.errors import RecipeError
from sft_recipes.launch import (
    AccelerateConfig, NodeLayout, ParallelismSizes, gpus_needed, header_accelerate_config, read_accelerate_config,
    runtime_layout,
)

CONFIGS = REPO_ROOT / "accelerate_configs"
SHIPPED = sorted(CONFIGS.glob("*.yaml"))
# Launched through torchrun (FSDP2, multi-process); cpu_1process.yaml is one plain process (accelerate's
# simple launcher exports no FSDP variables): tests/test_one_process_api.py checks what it exports.
TORCHRUN_CONFIGS = [path for path in SHIPPED if path.name != "cpu_1process.yaml"]
EXPORTED_PREFIXES = ("ACCELERATE_USE_", "ACCELERATE_MIXED_PRECISION", "FSDP_", "PARALLELISM_CONFIG_")


def hsdp_config(tmp_path, replicate: int, shard: int, processes: int = 8, cp: int = 1):
    values = yaml.safe_load((CONFIGS / "fsdp2_8gpu.yaml").read_text())
    values["num_processes"] = processes
    values["parallelism_config"] = {"parallelism_config_dp_replicate_size": replicate,
                                    "parallelism_config_dp_shard_size": shard}
    if cp > 1:
        values["parallelism_config"].update(parallelism_config_cp_size=cp, parallelism_config_cp_comm_strategy="alltoall")
    path = tmp_path / "hsdp.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def accelerates_own_environment(config_path, monkeypatch) -> dict[str, str]:
    """What accelerate 1.15's `launch --config_file PATH` computes for its training processes (its own code, in-process)."""
    for name in list(__import__("os").environ):
        if name.startswith(EXPORTED_PREFIXES):
            monkeypatch.delenv(name)
    args = launch_command_parser().parse_args(["--config_file", str(config_path), "--main_process_port", "0", "x.py"])
    args, _, _ = _validate_launch_command(args)
    return {name: value for name, value in prepare_multi_gpu_env(args).items() if name.startswith(EXPORTED_PREFIXES)}


@pytest.mark.parametrize("config", [path.name for path in TORCHRUN_CONFIGS] + ["hsdp 2x4", "cp 2 x shard 4"])
def test_launch_environment_is_exactly_what_accelerate_launch_exports(config, tmp_path, monkeypatch):
    path = {"hsdp 2x4": lambda: hsdp_config(tmp_path, 2, 4), "cp 2 x shard 4": lambda: hsdp_config(tmp_path, 1, 4, cp=2)}.get(
        config, lambda: CONFIGS / config)()
    assert read_accelerate_config(path).launch_environment() == accelerates_own_environment(path, monkeypatch)


def test_exported_sets_the_launch_environment_for_the_block_and_restores_it(monkeypatch):
    import os

    monkeypatch.setenv("FSDP_VERSION", "1")  # the caller's own value comes back
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    before = dict(os.environ)
    with read_accelerate_config(CONFIGS / "fsdp2_8gpu.yaml").exported():
        assert (os.environ["ACCELERATE_USE_FSDP"], os.environ["FSDP_ACTIVATION_CHECKPOINTING"], os.environ["FSDP_VERSION"],
                os.environ["ACCELERATE_MIXED_PRECISION"]) == ("true", "true", "2", "bf16")
    assert dict(os.environ) == before


@pytest.mark.parametrize(("config", "machines", "per_node", "precision"), [
    ("fsdp2_cpu.yaml", 1, 2, "no"), ("fsdp2_8gpu.yaml", 1, 8, "bf16"), ("fsdp2_2node.yaml", 2, 8, "bf16")])
def test_shipped_configs_layout(config, machines, per_node, precision):
    accelerate_config = read_accelerate_config(CONFIGS / config)
    assert (accelerate_config.num_machines, accelerate_config.processes_per_node, accelerate_config.num_processes,
            accelerate_config.mixed_precision) == (machines, per_node, machines * per_node, precision)
    assert accelerate_config.uses_fsdp and accelerate_config.fsdp_version == 2 and accelerate_config.parallelism is None
    assert accelerate_config.problems() == []
    assert runtime_layout(accelerate_config, {}) == NodeLayout(machines, per_node, 0)


def test_the_runtime_variables_override_the_config_layout():
    two_node = read_accelerate_config(CONFIGS / "fsdp2_2node.yaml")
    layout = runtime_layout(two_node, {"NUM_NODES": "2", "LOCAL_WORLD_SIZE": "1", "NODE_RANK": "1"})
    assert layout == NodeLayout(2, 1, 1) and layout.world_size == 2
    assert runtime_layout(two_node, {"LOCAL_WORLD_SIZE": "4"}).world_size == 8
    with pytest.raises(RecipeError, match="NUM_NODES='two' is not a whole number"):
        runtime_layout(two_node, {"NUM_NODES": "two"})


def test_parallelism_config_is_data_and_its_product_must_be_the_world_size(tmp_path):
    assert read_accelerate_config(hsdp_config(tmp_path, 2, 4)).parallelism == ParallelismSizes(dp_replicate=2, dp_shard=4)
    assert ParallelismSizes(dp_replicate=2, dp_shard=4, tp=2).total == 16
    wrong = read_accelerate_config(hsdp_config(tmp_path, 2, 2))
    assert wrong.problems() == [
        f"{wrong.path}: parallelism_config sizes multiply to 4 (dp_replicate 2 x dp_shard 2) but num_processes is 8: "
        "their product must be the world size"]
    hsdp = yaml.safe_load(hsdp_config(tmp_path, 2, 4).read_text())
    fsdp1 = AccelerateConfig({**hsdp, "fsdp_config": {"fsdp_version": 1}}, tmp_path / "v1.yaml")
    assert fsdp1.problems() == [f"{fsdp1.path}: parallelism_config needs distributed_type: FSDP with fsdp_version: 2 "
                                "(accelerate refuses it otherwise)"]


def test_what_accelerate_would_refuse_is_listed_with_the_fix(tmp_path):
    values = yaml.safe_load((CONFIGS / "fsdp2_2node.yaml").read_text())
    values.update(num_processes=15, nodes=2)
    values["fsdp_config"]["fsdp_sync_module_states"] = False
    problems = AccelerateConfig(values, tmp_path / "bad.yaml").problems()
    assert [problem.split(": ", 1)[1][:40] for problem in problems] == [
        "unknown key(s) nodes: accelerate 1.15 re", "num_processes 15 is not a multiple of nu",
        "fsdp_cpu_ram_efficient_loading needs fsd"]
    with pytest.raises(RecipeError, match="accelerate config not found: nowhere.yaml"):
        read_accelerate_config("nowhere.yaml")


@pytest.mark.parametrize(("recipe", "config"), [
    ("llama8b.yaml", "fsdp2_2node.yaml"), ("qwen27b.yaml", "fsdp2_8gpu.yaml"), ("gptoss120b.yaml", "fsdp2_8gpu.yaml"),
    ("tiny/llama8b.yaml", "fsdp2_cpu.yaml")])
def test_the_config_a_recipe_header_names(recipe, config, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    assert str(header_accelerate_config(REPO_ROOT / "recipes" / recipe)) == f"accelerate_configs/{config}"


def test_gpus_a_node_needs():
    two_node = read_accelerate_config(CONFIGS / "fsdp2_2node.yaml")
    assert gpus_needed(two_node, {}, None) == (8, "mixed_precision: bf16")
    assert gpus_needed(two_node, {"bf16": True}, 4) == (4, "mixed_precision: bf16, bf16: true")
    assert gpus_needed(read_accelerate_config(CONFIGS / "fsdp2_cpu.yaml"), {}, None) == (0, "")
    assert gpus_needed(two_node, {"use_cpu": True}, None) == (0, "")


def test_a_recipe_a_folder_or_broken_yaml_as_the_accelerate_config_is_refused_with_the_shipped_configs(tmp_path,
                                                                                                         monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    shipped = ", ".join(f"accelerate_configs/{path.name}" for path in SHIPPED)
    with pytest.raises(RecipeError) as err:
        read_accelerate_config("recipes/tiny/llama8b.yaml")  # accelerate launch: "A distributed_type must be specified"
    assert str(err.value) == ("recipes/tiny/llama8b.yaml is not an accelerate config: it has no distributed_type, which "
                              "accelerate launch requires (it reads like a recipe). Pass the path of an accelerate "
                              f"config file: one of {shipped}.")
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(RecipeError) as err:
        read_accelerate_config(tmp_path / "empty.yaml")
    assert str(err.value) == (f"{tmp_path / 'empty.yaml'} is not an accelerate config: it has no distributed_type, "
                              f"which accelerate launch requires. Pass the path of an accelerate config file: one of "
                              f"{shipped}.")
    with pytest.raises(RecipeError) as err:
        read_accelerate_config("accelerate_configs")
    assert str(err.value) == ("accelerate_configs is a folder, not an accelerate config file. Pass the path of an "
                              f"accelerate config file: one of {shipped}.")
    (tmp_path / "broken.yaml").write_text("num_processes: [2\n")
    with pytest.raises(RecipeError) as err:
        read_accelerate_config(tmp_path / "broken.yaml")
    assert str(err.value) == (
        f"{tmp_path / 'broken.yaml'} is not valid YAML: while parsing a flow sequence in \"<unicode string>\", line 1, "
        "column 16: num_processes: [2 ^ expected ',' or ']', but got '<stream end>' in \"<unicode string>\", line 2, "
        "column 1: ^. Fix the YAML at the line and column named (one `key: value` per line).")
