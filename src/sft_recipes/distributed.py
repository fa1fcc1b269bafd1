"""FSDP2 on any machine, and proof at start that the run really is what the launcher asked for.

accelerate 1.15 only promotes a run to FSDP on accelerators: on CPU the same config silently
becomes DDP over gloo (``use_cpu``) or N independent single-process runs, and still exits 0.
`enable_cpu_fsdp` closes that gap so the CPU test bed exercises the real FSDP2 code path, and
`verify_distributed` refuses to train when the trainer is not running what was launched.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
from collections.abc import Iterator

import torch
import torch.distributed.nn.functional  # noqa: F401 -- before any group exists (destroy_process_groups says why)
from accelerate.state import AcceleratorState, DistributedType, PartialState
from sft_recipes.errors import RecipeError
from sft_recipes.hsdp import DataParallelMesh


def launch_flag(name: str) -> bool:
    """A boolean that `accelerate launch` exported from its config file (e.g. FSDP_OFFLOAD_PARAMS)."""
    return os.environ.get(name, "false").lower() == "true"


def fsdp_requested() -> bool:
    """True when the launcher (accelerate config or TrainingArguments.fsdp) asked for FSDP."""
    return launch_flag("ACCELERATE_USE_FSDP")


def requested_fsdp_version(training_args=None) -> int:
    """The FSDP version the accelerate config (FSDP_VERSION) or the recipe's `fsdp_config` (torchrun) asks for."""
    if "FSDP_VERSION" in os.environ:
        return int(os.environ["FSDP_VERSION"])
    fsdp_config = getattr(training_args, "fsdp_config", None) or {}
    return int(fsdp_config.get("version", fsdp_config.get("fsdp_version", 1)))


def launched_world_size() -> int:
    """World size the launcher (torchrun / accelerate launch / srun) started, 1 without one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@contextlib.contextmanager
def process_group_destroyed_on_exit():
    """Destroy the default process group (and its subgroups) when the block exits, however it exits, and stop
    their backends' threads while the interpreter is still whole (`destroy_process_groups`)."""
    try:
        yield
    finally:
        destroy_process_groups()


def destroy_process_groups() -> None:
    """`destroy_process_group()`, and the backends' threads stopped now rather than at interpreter exit.

    A process that leaves those threads to interpreter shutdown can die with SIGABRT after a clean run
    ("terminate called without an active exception", exit -6 after the model card: gloo's worker threads
    still hold work objects whose tensors need the GIL while the interpreter is torn down; pytorch PR
    #179291, abandoned). `destroy_process_group()` alone does not stop them: it drops c10d's references,
    but every DeviceMesh keeps its groups in `_pg_registry` (torch 2.13), and the meshes outlive the run in
    DTensor's sharding-propagation and redistribute caches (lru caches holding DTensorSpecs). Measured at
    exit of a 2-process FSDP2 run on gloo: `gloo_tcp_loop` and two `pt_gloo_runloop` threads alive after
    destroy_process_group() and gc.collect(); none once the meshes' registries are emptied, because the
    last reference to each group goes and its destructor joins the threads. A second holder: the collectives
    of `torch.distributed.nn.functional` take `group=group.WORLD` as a default argument, evaluated when the
    module is imported -- imported after the group exists (`torch.distributed.fsdp` imports it), they keep
    the default group for the life of the process; this module imports it first, while no group exists.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    torch.distributed.destroy_process_group()
    from torch.distributed.device_mesh import DeviceMesh

    for candidate in gc.get_objects():  # meshes are reachable only through torch's caches: find them all
        # type(), not isinstance(): DeviceMesh's metaclass (torch._opaque_base) inspects the object, and after
        # torch.compile gc holds weakref proxies whose referent is gone (ReferenceError on any attribute)
        if issubclass(type(candidate), DeviceMesh):
            getattr(candidate, "_pg_registry", {}).clear()
    gc.collect()


@contextlib.contextmanager
def prepared_once_per_cache():
    """Run the block on the global main process first, then on each node's local main, then on the rest (TRL's
    `global_then_local_main_first`: work that fills a cache happens once per cache), where a process that goes
    first and fails still releases the ones waiting on it. Those then run the block and meet the same refusal
    on their own (data checks are deterministic), instead of dying in a barrier their first process left.
    """
    state = PartialState()

    @contextlib.contextmanager
    def goes_first(first: bool):
        if not first:
            state.wait_for_everyone()
        try:
            yield
        finally:
            if first:
                state.wait_for_everyone()

    with goes_first(state.is_main_process), goes_first(state.is_local_main_process):
        yield


def enable_cpu_fsdp() -> None:
    """Let accelerate run FSDP over gloo when there is no accelerator (idempotent).

    accelerate decides the distributed type once, in `AcceleratorState.__init__`, and only
    upgrades MULTI_GPU-like types to FSDP. We upgrade MULTI_CPU the same way, on both
    `AcceleratorState` and `PartialState`, whose shared state the Trainer reads afterwards.
    """
    if torch.cuda.is_available() or getattr(AcceleratorState.__init__, "_cpu_fsdp", False):
        return
    original_init = AcceleratorState.__init__

    @functools.wraps(original_init)
    def init_with_cpu_fsdp(self, *args, fsdp_plugin=None, **kwargs):
        original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if self.distributed_type == DistributedType.MULTI_CPU and fsdp_plugin is not None:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    init_with_cpu_fsdp._cpu_fsdp = True
    AcceleratorState.__init__ = init_with_cpu_fsdp


def verify_distributed(trainer) -> str:
    """Fail loudly unless the trainer runs what the launcher asked for; return a one-line summary.

    Checks: the world size the trainer sees equals the launched one (independent single-process
    runs are the silent failure mode), and FSDP2 is active when FSDP was requested.
    """
    accelerator = trainer.accelerator
    launched = launched_world_size()
    problems = []
    if accelerator.num_processes != launched:
        problems.append(
            f"the launcher started WORLD_SIZE={launched} processes but the trainer sees "
            f"num_processes={accelerator.num_processes} (each process is training alone)"
        )
    if fsdp_requested():
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
        version = getattr(plugin, "fsdp_version", None)
        if not trainer.is_fsdp_enabled or accelerator.distributed_type != DistributedType.FSDP:
            problems.append(
                f"the accelerate config asks for FSDP but the trainer runs {accelerator.distributed_type.value}"
            )
        elif version != 2 or requested_fsdp_version(trainer.args) != 2:
            problems.append(
                f"the config asks for FSDP{requested_fsdp_version(trainer.args)} and the trainer runs FSDP{version}; "
                "these recipes need FSDP2 (fsdp_version: 2)"
            )
    if problems:
        raise RecipeError(
            "Refusing to train: " + "; ".join(problems) + ". Launch with `.venv/bin/accelerate launch --config_file "
            "accelerate_configs/<config>.yaml scripts/sft.py RECIPE` (on CPU, scripts/sft.py enables FSDP "
            "through sft_recipes.distributed.enable_cpu_fsdp), and check num_processes/num_machines there."
        )
    kind = f"FSDP{requested_fsdp_version(trainer.args)}" if fsdp_requested() else accelerator.distributed_type.value
    mesh = getattr(accelerator, "parallelism_config", None)  # the mesh accelerate built from the config
    if mesh is not None and mesh.dp_replicate_size > 1:  # HSDP: the mesh, not only the process count
        hybrid = DataParallelMesh(mesh.dp_replicate_size, mesh.dp_shard_size)
        return f"{kind} {hybrid.describe()} on {accelerator.device.type}"
    return f"{kind} over {accelerator.num_processes} process(es) on {accelerator.device.type}"


def reduce_scatter_every_micro_batch(training_args) -> None:
    """Under FSDP2 with gradient accumulation, reduce-scatter the gradient after every micro-batch.

    The Trainer runs all but the last micro-batch of a step in accelerate's `no_sync`, which for FSDP2 is
    `set_requires_gradient_sync(False)`: torch then keeps each FSDP unit's gradient UNSHARDED until the last
    micro-batch (`FSDPParam.to_accumulated_grad_if_needed`), the full trainable gradient on every rank (measured
    on the CPU twin: docs/traps.md). `sync_each_batch` keeps it sharded, at one reduce-scatter per micro-batch.
    Must run before the trainer is built, where the accelerator reads the kwargs.
    """
    if not fsdp_requested() or training_args.gradient_accumulation_steps == 1:
        return
    kwargs = dict(training_args.accelerator_config.gradient_accumulation_kwargs or {})
    kwargs["sync_each_batch"] = True
    training_args.accelerator_config.gradient_accumulation_kwargs = kwargs


@contextlib.contextmanager
def replicas_reduced_at_the_step_end(model, last_micro_batch: bool) -> Iterator[None]:
    """Under HSDP, around a micro-batch that is not the step's last: reduce-scatter inside the replica (the
    gradient stays sharded, `reduce_scatter_every_micro_batch`) but leave the all-reduce across replicas for
    the last micro-batch, as transformers does for a model it sharded itself (`_defer_fsdp_gradient_reduction`):
    one gradient all-reduce over the network per optimizer step, not one per micro-batch. FSDP2 adds the
    micro-batches' reduce-scattered shards and all-reduces their sum (`set_requires_all_reduce`); a flat
    FSDP2 mesh has no all-reduce, so this changes nothing there."""
    set_all_reduce = getattr(model, "set_requires_all_reduce", None)
    if set_all_reduce is None or last_micro_batch:
        yield
        return
    set_all_reduce(False)
    try:
        yield
    finally:
        set_all_reduce(True)


def set_fsdp_reduce_dtype(trainer, dtype_name: str) -> None:
    """Reduce gradients in `dtype_name` under FSDP2 mixed precision (accelerate configs can't say it).

    Must run before `trainer.train()`, where accelerate applies the policy to the model.
    """
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    policy = getattr(plugin, "mixed_precision_policy", None)
    if policy is None:  # full precision: nothing is reduced in a lower dtype
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin.mixed_precision_policy = MixedPrecisionPolicy(
        param_dtype=policy.param_dtype,
        reduce_dtype=getattr(torch, dtype_name),
        output_dtype=policy.output_dtype,
        cast_forward_inputs=policy.cast_forward_inputs,
    )
