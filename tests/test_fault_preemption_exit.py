"""After the agreed preemption checkpoint every rank exits 75, whichever rank got the signal (torchrun, 2 CPU ranks)."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from conftest import REPO_ROOT, free_port
from fault_helpers import Run, finish, rank_exit_codes, wait_for, worker_pid
from sft_recipes.fault.preemption import REQUEUE_EXIT_CODE

pytestmark = pytest.mark.fsdp


def exit_codes_after_preempting(signalled_rank: int) -> dict[int, int]:
    run = Run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
               "--monitor_interval", "0.1", str(REPO_ROOT / "tests" / "preemption_exit.py")],
              {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    wait_for(lambda: run.output.count("READY rank=") == 2, run, "both ranks' signal handlers")
    os.kill(worker_pid(run, signalled_rank), signal.SIGTERM)
    result = finish(run)
    assert f"rank {signalled_rank} got SIGTERM" in result.output, result.output[-3000:]
    assert result.returncode != 0
    return rank_exit_codes(result.output)


@pytest.mark.parametrize("attempt", [1, 2])
@pytest.mark.parametrize("signalled_rank", [0, 1])
def test_every_rank_exits_for_requeue(signalled_rank, attempt):
    assert exit_codes_after_preempting(signalled_rank) == {0: REQUEUE_EXIT_CODE, 1: REQUEUE_EXIT_CODE}
