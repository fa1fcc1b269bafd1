"""How tests start their gloo worker processes: forked from one pre-imported server per pytest worker.

A spawned worker starts a fresh interpreter and imports torch, transformers, TRL and the package again before it
does anything (~5 s of CPU on 2 cores, ~20 such workers in a suite run). multiprocessing's forkserver starts one
server per pytest worker, on the first use, that imports `PRELOADED` once and forks every later worker from it. What
a worker runs is unchanged: its target and arguments are pickled as under spawn, and its own module imported by name.

A worker gets the environment the server started with (the pytest worker's, on first use), not the caller's at the
time of the call: a worker sets what it needs itself (MASTER_ADDR, RANK, ...), as every target here does.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable

import torch.multiprocessing as mp

START_METHOD = "forkserver"
# What the workers' modules import, the heaviest first; conftest brings torch, transformers' qwen3_5 (with fla) and
# the package
PRELOADED = ("conftest", "accelerate", "datasets", "peft", "trl", "transformers.models.llama.modeling_llama",
             "torch.distributed.fsdp", "sft_recipes.trainer", "sft_recipes.tiny",
             "sft_recipes.architectures.sequence_parallel")


def worker_context() -> multiprocessing.context.BaseContext:
    """The context for `context.Process(...)` workers."""
    context = multiprocessing.get_context(START_METHOD)
    context.set_forkserver_preload(list(PRELOADED))  # read when the server starts: the first call in a pytest worker
    return context


def spawn(target: Callable, args: tuple, nprocs: int) -> None:
    """`torch.multiprocessing.spawn(target, args, nprocs)` on the pre-imported server: target(rank, *args) in each
    process, all joined; a failed worker raises here with its traceback."""
    worker_context()
    mp.start_processes(target, args=args, nprocs=nprocs, join=True, start_method=START_METHOD)
