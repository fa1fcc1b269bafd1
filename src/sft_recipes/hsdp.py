"""HSDP under FSDP2: parameters sharded inside a replica (a node), replicated across replicas (nodes).

accelerate 1.15 builds it from the accelerate config's `parallelism_config`
(`parallelism_config_dp_replicate_size` x `parallelism_config_dp_shard_size`, product = num_processes):
`accelerate launch` exports them as PARALLELISM_CONFIG_DP_REPLICATE_SIZE / _DP_SHARD_SIZE (with
ACCELERATE_USE_PARALLELISM_CONFIG=true), the Accelerator builds the 2-D DeviceMesh
`(dp_replicate, dp_shard)` -- on CPU/gloo too -- and `fully_shard` receives its
`(dp_replicate, dp_shard_cp)` view: every parameter is a DTensor placed `(Replicate(), Shard(0))`.
Gradients are reduce-scattered inside the replica and all-reduced across replicas, averaged over all
processes, as flat FSDP averages them: the same step.

Every rank is a data reader (unlike a sequence-parallel group, whose ranks share blocks), so
everything that counts ranks -- the global batch, tokens/s per device, the global token count of
the loss, checkpoint layouts -- counts processes exactly as under flat FSDP; what differs is only
who holds which shard. `MeshCheck` proves at the first step that the model really is laid out as
launched (the run logs its mesh) and refuses to train otherwise.

What is refused, by `parallelism_problems` (run by `sft_recipes.lint`): a replicate x shard product
that is not the world size, tensor/context/DeepSpeed-sequence parallel sizes > 1 (not run by these
recipes), replicate > 1 with shard 1 (plain DDP, which accelerate rejects for FSDP2), and our
`sequence_parallel_size` > 1 together with replicate > 1 (not verified here; flat FSDP composes).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from transformers import TrainerCallback

from sft_recipes.errors import RecipeError
from sft_recipes.launch import PARALLELISM_DIMENSIONS, launched_parallelism, shipped_hsdp_configs

logger = logging.getLogger("sft")

# The accelerate config key that sets each parallelism size (what a refusal names).
_KEYS = {name: f"parallelism_config_{name}_size" for name in PARALLELISM_DIMENSIONS}


@dataclass(frozen=True)
class DataParallelMesh:
    """How the processes hold the model: `replicate` copies, each sharded over `shard` processes."""

    replicate: int
    shard: int

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard

    @property
    def is_hybrid(self) -> bool:
        return self.replicate > 1

    def describe(self) -> str:
        processes = f"{self.world_size} process{'es' if self.world_size > 1 else ''}"
        if self.is_hybrid:
            return f"HSDP {self.replicate} replicas x {self.shard} shards (dp_replicate x dp_shard) over {processes}"
        return f"FSDP 1 x {self.shard} (flat) over {processes}"


def launched_mesh(world_size: int) -> DataParallelMesh:
    """The data-parallel mesh of this launch: the parallelism_config's, or one flat shard group of every process."""
    sizes = launched_parallelism()
    if sizes is None:
        return DataParallelMesh(1, world_size)
    return DataParallelMesh(sizes.dp_replicate, sizes.dp_shard)


def parallelism_problems(world_size: int, sequence_parallel_size: int) -> list[str]:
    """Why this launch's parallelism_config cannot run these recipes, one message each with its fix."""
    sizes = launched_parallelism()
    if sizes is None:
        return []
    problems = []
    others = {name: getattr(sizes, name) for name in ("tp", "cp", "sp") if getattr(sizes, name) > 1}
    if others:
        given = ", ".join(f"{_KEYS[name]}: {size}" for name, size in others.items())
        problems.append(f"the accelerate config's parallelism_config sets {given}: tensor, context and DeepSpeed "
                        "sequence parallelism are not run by these recipes; set them to 1 (long sequences: the "
                        "recipe's sequence_parallel_size with flat FSDP)")
    replicate, shard = sizes.dp_replicate, sizes.dp_shard
    if sizes.total != world_size:
        factors = f"dp_replicate {replicate} x dp_shard {shard}" + "".join(
            f" x {name} {size}" for name, size in others.items())
        fits = [f"{r} x {world_size // r}" for r in range(1, world_size) if world_size % r == 0 and world_size // r > 1]
        fix = (f"set parallelism_config_dp_replicate_size x parallelism_config_dp_shard_size to {world_size} "
               f"(one of {', '.join(fits)}: replicas = nodes, shards = GPUs per node)" if fits
               else "drop parallelism_config")
        shipped = shipped_hsdp_configs(world_size, os.environ.get("ACCELERATE_MIXED_PRECISION"))
        if shipped:
            fix += f" -- as {' and '.join(shipped)} does"
        problems.append(f"the accelerate config's parallelism_config makes {factors} = {sizes.total} processes, but "
                        f"the launch has {world_size} (num_processes); {fix}, or launch on {sizes.total} processes")
    if replicate > 1 and shard == 1:
        problems.append(f"parallelism_config_dp_replicate_size {replicate} with parallelism_config_dp_shard_size 1 is "
                        "plain data parallelism, which FSDP2 cannot run; shard inside each replica (dp_shard > 1), or "
                        "drop parallelism_config for flat FSDP")
    if replicate > 1 and sequence_parallel_size > 1:
        problems.append(f"sequence_parallel_size {sequence_parallel_size} with HSDP (parallelism_config_dp_replicate_size "
                        f"{replicate}) is not supported; use HSDP with sequence_parallel_size: 1, or sequence "
                        "parallelism with flat FSDP (an accelerate config without parallelism_config, e.g. "
                        "accelerate_configs/fsdp2_2node.yaml)")
    return problems


def model_mesh_problem(model, mesh: DataParallelMesh) -> str | None:
    """Why the prepared (`fully_shard`-ed) model is not laid out on `mesh`, None when every parameter is.

    HSDP: each parameter a DTensor on a 2-D mesh of shape (replicate, shard), placed (Replicate(), Shard(0));
    flat FSDP: on a 1-D mesh of every process, placed (Shard(0),). Plain parameters are those FSDP was told to
    leave alone (accelerate's ignored_params); a model without a single DTensor was not sharded at all.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    expected_shape = (mesh.replicate, mesh.shard) if mesh.is_hybrid else (mesh.shard,)
    expected_placements = (Replicate(), Shard(0)) if mesh.is_hybrid else (Shard(0),)
    sharded = [(name, param) for name, param in model.named_parameters() if isinstance(param, DTensor)]
    if not sharded:
        return "no parameter of the model is sharded (all are plain tensors)"
    for name, param in sharded:
        shape, placements = tuple(param.device_mesh.shape), tuple(param.placements)
        if shape != expected_shape or placements != expected_placements:
            return (f"parameter {name} lies on a mesh of shape {shape} placed {placements}, not {expected_shape} "
                    f"placed {expected_placements}")
    return None


class MeshCheck(TrainerCallback):
    """At the start of training (the model is sharded by then): log the mesh, and refuse a model that is not laid
    out as launched -- e.g. a flat 4-way shard where the config asked for 2 replicas x 2 shards."""

    def __init__(self, mesh: DataParallelMesh) -> None:
        self.mesh = mesh

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if args.world_size == 1 or model is None:  # one process: nothing is sharded
            return
        problem = model_mesh_problem(model, self.mesh)
        if problem:
            raise RecipeError(f"the launch asked for {self.mesh.describe()}, but {problem}; check the accelerate "
                              "config's parallelism_config and fsdp_version: 2")
        if args.process_index == 0:  # accelerate's mesh is row-major: a replica is `shard` consecutive ranks (a node)
            replicas = "; ".join(f"replica {r}: ranks {r * self.mesh.shard}-{(r + 1) * self.mesh.shard - 1}"
                                 for r in range(self.mesh.replicate))
            logger.info("[mesh] %s (%s); every parameter Shard(0) over the %d processes of its replica%s",
                        self.mesh.describe(), replicas, self.mesh.shard,
                        f", Replicate() across the {self.mesh.replicate} replicas" if self.mesh.is_hybrid else "")
