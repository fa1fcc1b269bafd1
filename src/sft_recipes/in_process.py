"""A recipe run inside a process someone else started: a notebook's `@distributed` function, torch.multiprocessing.

`accelerate launch --config_file C scripts/sft.py` does three things our code relies on: it starts the
processes with the rendezvous variables (here the caller did: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), it exports config C as environment variables that `Accelerator` reads (ACCELERATE_USE_FSDP,
FSDP_VERSION, FSDP_ACTIVATION_CHECKPOINTING, ACCELERATE_MIXED_PRECISION, ...), and each process ends with
the run, taking every piece of process-wide state with it. `in_process_launch` does the second -- with
accelerate's own launcher code (`_validate_launch_command` + `prepare_multi_gpu_env`, accelerate 1.15), so
the variables are exactly the ones `accelerate launch` would export -- and undoes, at the end, what a run
leaves behind that would break the next call in the same process (traps found here):

- the environment: besides the launch variables, a run sets FSDP_TRANSFORMER_CLS_TO_WRAP (fsdp_wrap.py) and
  the MLflow defaults (tracking.py); a second recipe with another model would inherit the first one's
  wrap classes. Restored as it was, except MLFLOW_RUN_ID once MLflow consumed it (mlflow.start_run
  deletes it from the environment so that the next run is a new one; restoring it would log a second
  recipe into the first one's run, where MLflow refuses changed params);
- accelerate's singletons (`PartialState`, `AcceleratorState`, `GradientState`): they keep the first
  run's distributed type, FSDP plugin and mixed precision, and a second Accelerator silently reuses them;
- the default process group (and its subgroups: sequence parallelism; their backends' threads too,
  `distributed.destroy_process_groups`), when this call created it, after
  every rank got there; one the caller made before the call is the caller's and stays. The group is made
  here, over one rendezvous store per process (on MASTER_PORT, kept for the next call) with a key prefix
  per call (`_start_process_group` says why);
- an MLflow run left active by a failed run (the next one would log into it); the console: the run
  tees stdout/stderr into its train.log (reporting/console.py; a second call would write into both
  logs) and quiets ranks > 0 (transformers'/datasets' verbosity and progress bars); the log handler
  added for the call.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist

from sft_recipes.distributed import destroy_process_groups
from sft_recipes.errors import RecipeError
from sft_recipes.launch import read_accelerate_config
from sft_recipes.reporting.mlflow_status import end_active_mlflow_run

RENDEZVOUS_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def caller_world() -> tuple[int, int]:
    """(rank, world size) the caller started this process with; (0, 1) for a plain single process.

    RecipeError when only some rendezvous variables are set: torch would wait for the missing ones.
    """
    present = [name for name in RENDEZVOUS_ENV if name in os.environ]
    if not present:
        return 0, 1
    missing = [name for name in RENDEZVOUS_ENV if name not in os.environ]
    if missing:
        raise RecipeError(f"train() runs in a process started with {', '.join(present)} but without "
                          f"{', '.join(missing)}: start it with all of {', '.join(RENDEZVOUS_ENV)} (a distributed "
                          "decorator or torch.multiprocessing sets them), or with none for a single process.")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def accelerate_launch_environment(config_file: str | os.PathLike, world_size: int) -> dict[str, str]:
    """The variables `accelerate launch --config_file CONFIG` exports to its processes (`sft_recipes.launch`).

    RecipeError for what accelerate's launcher would refuse in the config, and when the config launches another
    number of processes than the caller started: that layout (num_processes over num_machines) is what the
    recipe header and the plan were made for.
    """
    config = read_accelerate_config(config_file)
    problems = config.problems()
    if config.num_processes != world_size:
        problems.append(f"{config.name} launches {config.num_processes} processes (num_processes) but train() runs in "
                        f"a world of {world_size} (WORLD_SIZE): start {config.num_processes} processes (e.g. "
                        f"gpus={config.num_processes}), or pass the accelerate config made for {world_size}"
                        + (" (accelerate_configs/cpu_1process.yaml for one process)" if world_size == 1 else ""))
    if config.get("distributed_type") == "DEEPSPEED":
        problems.append(f"{config.name} is a DeepSpeed config: these recipes train with FSDP2 (accelerate_configs/)")
    if problems:
        raise RecipeError("; ".join(problems) + ".")
    return config.launch_environment()


@contextlib.contextmanager
def _restored_environment() -> Iterator[None]:
    before = dict(os.environ)
    try:
        yield
    finally:
        consumed_run_id = "MLFLOW_RUN_ID" in before and "MLFLOW_RUN_ID" not in os.environ
        os.environ.clear()
        os.environ.update(before)
        if consumed_run_id:
            del os.environ["MLFLOW_RUN_ID"]


@contextlib.contextmanager
def _visible_logs() -> Iterator[None]:
    """Our INFO lines on stderr for the call (a notebook's root logger often has no handler), then the console as
    before: the run tees stdout/stderr (and the handlers writing there) into its train.log, and quiets ranks > 0
    (transformers' and datasets' verbosity and progress bars) -- a second call would tee into both logs."""
    import datasets
    import transformers

    from sft_recipes.reporting.console import close_train_log

    root = logging.getLogger()
    added = None
    level = root.level
    if not root.handlers:
        added = logging.StreamHandler(sys.stderr)
        added.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(added)
        root.setLevel(logging.INFO)
    streams = sys.stdout, sys.stderr
    handler_streams = {handler: handler.stream for logger in [root, *logging.Logger.manager.loggerDict.values()]
                       if isinstance(logger, logging.Logger) for handler in logger.handlers
                       if isinstance(handler, logging.StreamHandler)}
    verbosity = transformers.logging.get_verbosity(), datasets.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled(), datasets.utils.are_progress_bars_disabled()
    try:
        yield
    finally:
        close_train_log()
        sys.stdout, sys.stderr = streams
        for handler, stream in handler_streams.items():
            handler.setStream(stream)
        transformers.logging.set_verbosity(verbosity[0])
        datasets.logging.set_verbosity(verbosity[1])
        if bars[0]:
            transformers.utils.logging.enable_progress_bar()
        if not bars[1]:
            datasets.enable_progress_bars()
        if added is not None:
            root.removeHandler(added)
            root.setLevel(level)


_RENDEZVOUS: list = []  # [TCPStore, calls so far]: one store per process, a fresh key prefix per call


def _start_process_group(rank: int, world_size: int) -> None:
    """The default process group for one call, over the process's rendezvous store under a prefix of its own.

    A group made by torch's env:// rendezvous for each call met the previous call's store: a rank that left
    first re-created it on MASTER_PORT while the other still held the old one (stale keys, the old peer
    addresses), and the two waited forever in different collectives (seen: rank 0 in gloo's connectFullMesh,
    rank 1 in the previous group's barrier). Every rank makes the same calls, so the prefixes agree.
    """
    from datetime import timedelta

    if not _RENDEZVOUS:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=rank == 0, timeout=timedelta(minutes=30))
        _RENDEZVOUS[:] = [store, 0]
    store, calls = _RENDEZVOUS
    _RENDEZVOUS[1] = calls + 1
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, store=dist.PrefixStore(f"sft_recipes.train/{calls}", store), rank=rank,
                            world_size=world_size)


def _leave_together() -> None:
    """Wait for every rank before the group goes: a rank that met a refusal first would otherwise destroy the
    group while a slower one is still connecting to it (seen: gloo "connectFullMesh failed ... Connection
    refused" on rank 1 after rank 0's lint refusal, under load). Refusals are met by every rank, so all arrive;
    a rank that failed alone makes this wait end at the group's timeout (`ddp_timeout` once the run started)."""
    try:
        dist.barrier()
    except RuntimeError:  # a peer is gone: nothing left to wait for
        pass


def _reset_accelerate_state() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@contextlib.contextmanager
def in_process_launch(accelerate_config: str | os.PathLike | None) -> Iterator[None]:
    """Run the block as `accelerate launch --config_file accelerate_config` would run it in this process, then
    leave the process as it was (see the module docstring). `None`: the launcher already exported the config
    (scripts/sft.py under `accelerate launch`) or there is none (a single process without FSDP)."""
    rank, world_size = caller_world()
    group_before = dist.is_available() and dist.is_initialized()
    error: BaseException | None = None
    with _restored_environment(), _visible_logs():
        try:
            if accelerate_config is not None:
                os.environ.update(accelerate_launch_environment(accelerate_config, world_size))
            _reset_accelerate_state()  # whatever an earlier Accelerator in this process left
            if world_size > 1 and not group_before:
                _start_process_group(rank, world_size)  # accelerate then uses it
            yield
        except BaseException as raised:
            error = raised
            raise
        finally:
            end_active_mlflow_run(error)  # FINISHED, or FAILED / KILLED (preempted): the next call starts its own
            _reset_accelerate_state()
            if not group_before and dist.is_available() and dist.is_initialized():
                _leave_together()
                destroy_process_groups()  # and their threads: a notebook calls train() again and again
            gc.collect()  # the trainer, model and optimizer of this call
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
