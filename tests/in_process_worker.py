"""A stand-in for a notebook's `@distributed` decorator: torch.multiprocessing workers that each call
`sft_recipes.train()` several times in the same process and record what every call returned or raised,
and what it left behind (for tests/test_python_api.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch.multiprocessing as mp

LEAK_ENV_PREFIXES = ("ACCELERATE_", "FSDP_")  # what the accelerate config (and fsdp_wrap.py) export for a call


def _worker(rank: int, world_size: int, port: int, calls: list[dict], results: str, env: dict[str, str]) -> None:
    os.environ.update({**env, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, PartialState

    from sft_recipes import train
    from sft_recipes.errors import RecipeError

    torch.set_num_threads(1)
    inherited = {name for name in os.environ if name.startswith(LEAK_ENV_PREFIXES)}  # the caller's, not a call's
    outcomes = []
    for call in calls:
        try:
            result = train(**call)
            outcome = {"losses": {str(step): loss for step, loss in result.losses.items()},
                       "output_dir": result.output_dir, "eval_loss": result.eval_loss,
                       "export_check": result.export_check.status, "mlflow_run_id": result.mlflow_run_id,
                       "has_summary": result.summary is not None}
        except RecipeError as err:
            outcome = {"refused": str(err)}
        outcome["left_behind"] = {
            "process_group": dist.is_initialized(),
            "accelerate_state": bool(PartialState._shared_state or AcceleratorState._shared_state),
            "env": sorted(name for name in os.environ if name.startswith(LEAK_ENV_PREFIXES) and name not in inherited),
        }
        outcomes.append(outcome)
    Path(results, f"rank{rank}.json").write_text(json.dumps(outcomes))


def run_in_processes(calls: list[dict], results: Path, port: int, world_size: int = 2,
                     env: dict[str, str] | None = None, timeout: float = 600) -> list[int | None]:
    """Start `world_size` spawned workers running `calls` in order; the exit code of each (None: still running at
    `timeout`, then killed -- a hung rank)."""
    context = mp.get_context("spawn")
    workers = [context.Process(target=_worker, args=(rank, world_size, port, calls, str(results), env or {}))
               for rank in range(world_size)]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + timeout
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
    codes = [worker.exitcode for worker in workers]
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join()
    return codes


def outcomes(results: Path, world_size: int = 2) -> list[list[dict]]:
    """Per rank, the outcome of each call."""
    return [json.loads(Path(results, f"rank{rank}.json").read_text()) for rank in range(world_size)]
