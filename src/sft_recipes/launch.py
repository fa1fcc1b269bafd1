"""The launch layout, in one place: accelerate configs, the config a recipe header names, what
`accelerate launch` exports from a config, and nodes x processes per node.

Everything that has to agree with a launch reads it here: `--dry-run` (planner/dry_run.py), the
launch preflight (preflight_launch.py, run by scripts/launch_multinode.sh), the workload check
(workload.py) and in-process entry points that must apply a config the way `accelerate launch`
would. Reads YAML only: nothing of torch or the run is imported.

Facts from accelerate 1.15 this module encodes (`accelerate/commands/launch.py`,
`accelerate/utils/launch.py: prepare_multi_gpu_env`, `commands/config/config_args.py`):

- A config file with a key accelerate's `ClusterConfig` does not know is refused at launch
  ("had unknown keys"); `fsdp_config:` keys are copied onto the launch arguments under their own
  names (a key without the `fsdp_` prefix gets it).
- `distributed_type: FSDP` (without `use_cpu`/`--cpu`) goes through the multi-GPU launcher, which
  exports ACCELERATE_USE_FSDP, FSDP_VERSION (default "1"!), FSDP_RESHARD_AFTER_FORWARD,
  FSDP_OFFLOAD_PARAMS, FSDP_ACTIVATION_CHECKPOINTING, ... each with the launcher's default when the
  config leaves it out (`FSDP_DEFAULTS`), and ACCELERATE_MIXED_PRECISION ("no" when unset).
  `fsdp_cpu_ram_efficient_loading` without `fsdp_sync_module_states` is refused there.
- `parallelism_config:` (keys `parallelism_config_dp_replicate_size`, `_dp_shard_size`, `_tp_size`,
  `_cp_size`, `_sp_size`, each default 1) needs FSDP version 2 and is exported as
  PARALLELISM_CONFIG_*; accelerate's `ParallelismConfig` refuses sizes whose product is not the
  world size (`num_processes`: the total over all machines in a config file) unless it is 1.
- `num_processes` in a config file is the TOTAL number of processes; per node it is
  `num_processes / num_machines` (torchrun's nproc_per_node). A runtime (Databricks AI Runtime,
  Slurm through scripts/launch_multinode.sh) overrides both from NUM_NODES and LOCAL_WORLD_SIZE,
  and the machine rank from NODE_RANK (`runtime_layout`).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from sft_recipes.errors import RecipeError

GPU_PRECISIONS = ("bf16", "fp16", "fp8")

# accelerate 1.15 `launch` defaults for the FSDP arguments it always exports (commands/launch.py).
FSDP_DEFAULTS = {
    "fsdp_version": "1",
    "fsdp_sharding_strategy": "FULL_SHARD",
    "fsdp_reshard_after_forward": "true",
    "fsdp_offload_params": "false",
    "fsdp_min_num_params": str(int(1e8)),
    "fsdp_forward_prefetch": "false",
    "fsdp_use_orig_params": "true",
    "fsdp_cpu_ram_efficient_loading": "true",
    "fsdp_sync_module_states": "true",
    "fsdp_activation_checkpointing": "false",
    "fsdp_activation_checkpointing_offload": "false",
}
# fsdp_config key -> the variable accelerate's multi-GPU launcher exports (always: default above when unset).
_FSDP_ALWAYS = {
    "fsdp_version": "FSDP_VERSION",
    "fsdp_sharding_strategy": "FSDP_SHARDING_STRATEGY",
    "fsdp_reshard_after_forward": "FSDP_RESHARD_AFTER_FORWARD",
    "fsdp_offload_params": "FSDP_OFFLOAD_PARAMS",
    "fsdp_min_num_params": "FSDP_MIN_NUM_PARAMS",
    "fsdp_forward_prefetch": "FSDP_FORWARD_PREFETCH",
    "fsdp_use_orig_params": "FSDP_USE_ORIG_PARAMS",
    "fsdp_cpu_ram_efficient_loading": "FSDP_CPU_RAM_EFFICIENT_LOADING",
    "fsdp_sync_module_states": "FSDP_SYNC_MODULE_STATES",
    "fsdp_activation_checkpointing": "FSDP_ACTIVATION_CHECKPOINTING",
    "fsdp_activation_checkpointing_offload": "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD",
}
# ... and exported only when the config sets them.
_FSDP_WHEN_SET = {
    "fsdp_auto_wrap_policy": "FSDP_AUTO_WRAP_POLICY",
    "fsdp_transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP",
    "fsdp_backward_prefetch": "FSDP_BACKWARD_PREFETCH",
    "fsdp_state_dict_type": "FSDP_STATE_DICT_TYPE",
    "fsdp_ignored_modules": "FSDP_IGNORED_MODULES",
}
PARALLELISM_DIMENSIONS = ("dp_replicate", "dp_shard", "tp", "cp", "sp")
_PARALLELISM_PREFIX = "parallelism_config_"
# accelerate 1.15 `launch` defaults of the parallelism_config settings that are not sizes.
PARALLELISM_DEFAULTS = {
    "parallelism_config_cp_backend": "torch",
    "parallelism_config_cp_comm_strategy": "allgather",
    "parallelism_config_sp_backend": "deepspeed",
    "parallelism_config_sp_seq_length": None,
    "parallelism_config_sp_seq_length_is_variable": True,
    "parallelism_config_sp_attn_implementation": "sdpa",
}

# ClusterConfig's fields in accelerate 1.15 (a config file with any other top-level key is refused at launch).
ACCELERATE_CONFIG_KEYS = frozenset({
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes",
    "machine_rank", "num_machines", "gpu_ids", "main_process_ip", "main_process_port", "rdzv_backend",
    "same_network", "main_training_function", "enable_cpu_affinity", "fp8_config", "downcast_bf16", "tpu_name",
    "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env",
    "dynamo_config", "deepspeed_config", "fsdp_config", "parallelism_config", "megatron_lm_config", "ipex_config",
    "mpirun_config",
})

_HEADER_CONFIG = re.compile(r"accelerate_configs/[\w.-]+\.yaml")


def _flag(value: object) -> str:
    """A config value the way accelerate's launcher writes it into the environment (`str(x).lower()`)."""
    return str(value).lower()


@dataclass(frozen=True)
class ParallelismSizes:
    """accelerate's `parallelism_config:` block as data (HSDP = dp_replicate x dp_shard; sizes default 1)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    sp: int = 1

    @property
    def total(self) -> int:
        return math.prod(getattr(self, name) for name in PARALLELISM_DIMENSIONS)


@dataclass(frozen=True)
class AccelerateConfig:
    """One accelerate config file, read; `values` is the YAML mapping as written."""

    values: Mapping = field(default_factory=dict)
    path: Path | None = None

    @property
    def name(self) -> str:
        return str(self.path) if self.path else "the accelerate config"

    def get(self, key: str, default=None):
        return self.values.get(key, default)

    @property
    def fsdp(self) -> dict:
        """`fsdp_config:` with every key under its `fsdp_`-prefixed name, as accelerate reads it."""
        raw = self.values.get("fsdp_config") or {}
        return {(key if key.startswith("fsdp") else f"fsdp_{key}"): value for key, value in raw.items()}

    @property
    def uses_fsdp(self) -> bool:
        return self.values.get("distributed_type") == "FSDP"

    @property
    def fsdp_version(self) -> int:
        return int(self.fsdp.get("fsdp_version", FSDP_DEFAULTS["fsdp_version"]))

    @property
    def mixed_precision(self) -> str:
        return _flag(self.values.get("mixed_precision") or "no")

    @property
    def uses_cpu(self) -> bool:
        return bool(self.values.get("use_cpu"))

    @property
    def num_machines(self) -> int:
        return int(self.values.get("num_machines") or 1)

    @property
    def num_processes(self) -> int:
        """All processes of the launch, over every machine (accelerate's meaning in a config file)."""
        return int(self.values.get("num_processes") or 1)

    @property
    def processes_per_node(self) -> int:
        return self.num_processes // self.num_machines

    @property
    def parallelism(self) -> ParallelismSizes | None:
        raw = self.values.get("parallelism_config") or {}
        if not raw:
            return None
        sizes = {}
        for key, value in raw.items():
            name = key.removeprefix(_PARALLELISM_PREFIX).removesuffix("_size")
            if name in PARALLELISM_DIMENSIONS and key.endswith("_size"):
                sizes[name] = int(value)
        return ParallelismSizes(**sizes)

    def problems(self) -> list[str]:
        """What `accelerate launch` (or accelerate's ParallelismConfig) would refuse in this config, each with its fix."""
        problems = []
        unknown = sorted(set(self.values) - ACCELERATE_CONFIG_KEYS)
        if unknown:
            problems.append(f"{self.name}: unknown key(s) {', '.join(unknown)}: accelerate 1.15 refuses the file "
                            "at launch; remove them (see accelerate_configs/ for the keys we use)")
        if self.num_processes % self.num_machines:
            problems.append(f"{self.name}: num_processes {self.num_processes} is not a multiple of num_machines "
                            f"{self.num_machines} (num_processes counts every process on every machine)")
        fsdp = self.fsdp
        if (self.uses_fsdp and _flag(fsdp.get("fsdp_cpu_ram_efficient_loading", "true")) == "true"
                and _flag(fsdp.get("fsdp_sync_module_states", "true")) != "true"):
            problems.append(f"{self.name}: fsdp_cpu_ram_efficient_loading needs fsdp_sync_module_states: true "
                            "(accelerate refuses the launch otherwise)")
        parallelism = self.parallelism
        if parallelism is not None:
            unknown_sizes = sorted(key for key in self.values["parallelism_config"]
                                   if key.endswith("_size") and key.removeprefix(_PARALLELISM_PREFIX)
                                   .removesuffix("_size") not in PARALLELISM_DIMENSIONS)
            if unknown_sizes:
                problems.append(f"{self.name}: parallelism_config key(s) {', '.join(unknown_sizes)} are not "
                                f"accelerate's; use parallelism_config_{{{','.join(PARALLELISM_DIMENSIONS)}}}_size")
            if not self.uses_fsdp or self.fsdp_version != 2:
                problems.append(f"{self.name}: parallelism_config needs distributed_type: FSDP with fsdp_version: 2 "
                                "(accelerate refuses it otherwise)")
            if parallelism.total not in (1, self.num_processes):
                sizes = " x ".join(f"{name} {getattr(parallelism, name)}" for name in PARALLELISM_DIMENSIONS
                                   if getattr(parallelism, name) != 1)
                problems.append(f"{self.name}: parallelism_config sizes multiply to {parallelism.total} ({sizes}) but "
                                f"num_processes is {self.num_processes}: their product must be the world size")
        return problems

    def launch_environment(self) -> dict[str, str]:
        """The variables `accelerate launch --config_file THIS` sets for the training processes (accelerate 1.15),
        rendezvous and per-process ranks aside (torchrun's), OMP_NUM_THREADS and dynamo aside."""
        env = {"ACCELERATE_MIXED_PRECISION": self.mixed_precision}
        if self.uses_cpu:
            env["ACCELERATE_USE_CPU"] = "True"
            return env
        if self.uses_fsdp:
            env["ACCELERATE_USE_FSDP"] = "true"
            fsdp = {**FSDP_DEFAULTS, **self.fsdp}
            env.update({variable: _flag(fsdp[key]) if key != "fsdp_sharding_strategy" else str(fsdp[key])
                        for key, variable in _FSDP_ALWAYS.items()})
            env.update({variable: str(fsdp[key]) for key, variable in _FSDP_WHEN_SET.items()
                        if fsdp.get(key) is not None})
        parallelism = self.parallelism
        if parallelism is not None:
            env["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true"
            env.update({f"PARALLELISM_CONFIG_{name.upper()}_SIZE": str(getattr(parallelism, name))
                        for name in PARALLELISM_DIMENSIONS})
            raw = {**PARALLELISM_DEFAULTS, **self.values["parallelism_config"]}
            exported = ["cp_backend", "sp_backend"]
            exported += ["cp_comm_strategy"] * (parallelism.cp > 1)
            exported += ["sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation"] * (parallelism.sp > 1)
            env.update({f"PARALLELISM_CONFIG_{key.upper()}": str(raw[_PARALLELISM_PREFIX + key]) for key in exported})
        return env

    @contextlib.contextmanager
    def exported(self) -> Iterator[None]:
        """`launch_environment()` set in this process while the block runs, so what reads the launch (lint, the
        plan) sees this config; the environment as it was afterwards (an in-process caller -- a notebook, a
        test -- would otherwise carry this config's FSDP_* into its next run)."""
        before = dict(os.environ)
        os.environ.update(self.launch_environment())
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(before)


def launched_parallelism(environ: Mapping[str, str] | None = None) -> ParallelismSizes | None:
    """The parallelism_config sizes a launch exported (`AccelerateConfig.launch_environment`'s PARALLELISM_CONFIG_*,
    as accelerate's ParallelismConfig reads them in the training process); None for a launch without one."""
    environ = os.environ if environ is None else environ
    if _flag(environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false")) != "true":
        return None
    return ParallelismSizes(**{name: int(environ.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1"))
                               for name in PARALLELISM_DIMENSIONS})


def read_yaml(path: Path, origin: str):
    """A YAML file's values; a syntax error is one refusal naming where it is (PyYAML's report on one line)."""
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise RecipeError(f"{origin} is not valid YAML: {' '.join(str(err).split())}. Fix the YAML at the line and "
                          "column named (one `key: value` per line).") from None


def shipped_hsdp_configs(world_size: int, mixed_precision: str | None = None) -> list[str]:
    """The shipped accelerate configs whose HSDP mesh (replicas x shards) is `world_size` processes (and, given, whose
    mixed_precision is the launch's), e.g. for 32 in bf16: `accelerate_configs/hsdp_4node.yaml (4 x 8)`."""
    fitting = []
    for path in sorted(Path("accelerate_configs").glob("*.yaml")):
        try:
            config = AccelerateConfig(read_yaml(path, str(path)) or {}, path)
            sizes = config.parallelism
        except (RecipeError, ValueError, AttributeError):  # not a config of ours to suggest
            continue
        same_precision = mixed_precision is None or str(config.get("mixed_precision")).lower() == mixed_precision.lower()
        if sizes and sizes.dp_replicate > 1 and sizes.total == world_size and same_precision:
            fitting.append(f"{path.as_posix()} ({sizes.dp_replicate} x {sizes.dp_shard})")
    return fitting


def pass_an_accelerate_config() -> str:
    """The fix for a --config_file / CONFIG that is not an accelerate config: the shipped ones by name."""
    shipped = ", ".join(sorted(p.as_posix() for p in Path("accelerate_configs").glob("*.yaml")))
    return ("Pass the path of an accelerate config file"
            + (f": one of {shipped}." if shipped else ", e.g. accelerate_configs/fsdp2_8gpu.yaml."))


def read_accelerate_config(path: str | os.PathLike) -> AccelerateConfig:
    path = Path(path)
    if path.is_dir():
        raise RecipeError(f"{path} is a folder, not an accelerate config file. {pass_an_accelerate_config()}")
    if not path.is_file():
        raise RecipeError(f"accelerate config not found: {path}. {pass_an_accelerate_config()}")
    values = read_yaml(path, str(path)) or {}
    if not isinstance(values, dict):
        raise RecipeError(f"{path} is not an accelerate config: it must be a mapping of key: value, got "
                          f"{type(values).__name__}. {pass_an_accelerate_config()}")
    if "distributed_type" not in values:  # accelerate launch: "A distributed_type must be specified in the config file."
        reads_like_a_recipe = any(key in values for key in ("model_name_or_path", "output_dir", "datasets", "dataset_name"))
        looks_like = " (it reads like a recipe)" if reads_like_a_recipe else ""
        raise RecipeError(f"{path} is not an accelerate config: it has no distributed_type, which accelerate launch "
                          f"requires{looks_like}. {pass_an_accelerate_config()}")
    return AccelerateConfig(values, path)


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


def config_for_recipe(config_file: str | None, recipe_path: str | os.PathLike) -> AccelerateConfig | None:
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


def planned_world_size(config: AccelerateConfig | None, world_size: int | None) -> int:
    if world_size:
        return world_size
    if config and config.get("num_processes"):
        return config.num_processes
    raise RecipeError("--dry-run needs the world size: pass --config_file accelerate_configs/<config>.yaml or --world_size N.")


@dataclass(frozen=True)
class NodeLayout:
    """Where a launch runs: nodes x processes per node, and which node this is."""

    nodes: int
    processes_per_node: int
    node_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node


def runtime_layout(config: AccelerateConfig, environ: Mapping[str, str] | None = None) -> NodeLayout:
    """The layout scripts/launch_multinode.sh launches: the runtime's NUM_NODES / LOCAL_WORLD_SIZE / NODE_RANK
    (Databricks AI Runtime, Slurm, ...) where set, else the config's num_machines and num_processes / num_machines."""
    environ = os.environ if environ is None else environ

    def number(name: str, default: int) -> int:
        text = environ.get(name, "")
        if not text:
            return default
        if not text.isdigit():
            raise RecipeError(f"{name}={text!r} is not a whole number: the runtime sets it; unset it to use the config's")
        return int(text)

    return NodeLayout(number("NUM_NODES", config.num_machines), number("LOCAL_WORLD_SIZE", config.processes_per_node),
                      number("NODE_RANK", 0))


def gpus_needed(config: AccelerateConfig, recipe: Mapping, processes_per_node: int | None) -> tuple[int, str]:
    """(GPUs one node needs, why) -- (0, "") for a CPU run (mixed_precision 'no' and a recipe without bf16/fp16)."""
    if recipe.get("use_cpu") or config.uses_cpu:
        return 0, ""
    reasons = []
    if config.mixed_precision in GPU_PRECISIONS:
        reasons.append(f"mixed_precision: {config.get('mixed_precision')}")
    reasons += [f"{key}: true" for key in ("bf16", "fp16") if recipe.get(key) is True]
    if not reasons:
        return 0, ""
    return processes_per_node or config.processes_per_node, ", ".join(reasons)


def main(argv: list[str] | None = None) -> int:
    """`python -m sft_recipes.launch processes-per-node CONFIG`: the processes one node of CONFIG starts
    (num_processes / num_machines), what scripts/launch_multinode.sh starts on a node without GPUs."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("question", choices=["processes-per-node"])
    parser.add_argument("config", help="an accelerate config file, e.g. accelerate_configs/fsdp2_cpu.yaml")
    args = parser.parse_args(argv)
    print(read_accelerate_config(args.config).processes_per_node)
    return 0


if __name__ == "__main__":
    from sft_recipes.errors import one_line_refusals

    sys.exit(one_line_refusals(main))
