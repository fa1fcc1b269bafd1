"""Two worker processes (tests/worker_processes.py) train one FSDP2 step over gloo, tear the group down, and
report which of gloo's native threads are still running (for tests/test_distributed.py): the threads a finished run
must not leave to interpreter exit."""

from __future__ import annotations

import json
import os
from pathlib import Path

from worker_processes import worker_context

GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")  # gloo's transport loop, ProcessGroupGloo's workers


def native_threads() -> list[str]:
    names = []
    for task in sorted(Path("/proc/self/task").iterdir()):
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended while we looked
            pass
    return names


def _train_one_step() -> list[str]:
    """One FSDP2 step; returns gloo's threads meanwhile. Model and optimizer end with the call, as a run's do."""
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DTensor ops fill torch's sharding caches
    optimizer.step()
    return native_threads()


def _worker(rank: int, port: int, teardown: str, results: str) -> None:
    import gc

    import torch.distributed as dist

    from sft_recipes.distributed import destroy_process_groups  # as a run does: imported before the group exists

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    during = _train_one_step()
    if teardown == "ours":
        destroy_process_groups()
    else:
        dist.destroy_process_group()
        gc.collect()
    after = native_threads()
    Path(results, f"rank{rank}.json").write_text(json.dumps({"during": during, "after": after}))
    os._exit(0)  # the report is written; what interpreter exit does with live threads is not this test's question


def gloo_threads_after(teardown: str, results: Path, port: int) -> list[dict[str, list[str]]]:
    """Per rank, gloo's threads while training and after the teardown ("ours" or torch's destroy_process_group)."""
    context = worker_context()
    workers = [context.Process(target=_worker, args=(rank, port, teardown, str(results))) for rank in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
        assert worker.exitcode == 0, f"worker exited {worker.exitcode}"
    reports = [json.loads(Path(results, f"rank{rank}.json").read_text()) for rank in range(2)]
    return [{when: [name for name in report[when] if name in GLOO_THREADS] for when in report} for report in reports]
