"""A refusing rank exits 2 even when the launcher stops it first.

Under `accelerate launch` (torchrun's elastic agent) the agent polls its workers; once one has
exited non-zero it SIGTERMs every other one and reports each exit code. The ranks of a run meet
the same refusal (a typo in an override, a missing file) at about the same time, but not at the
same instant: a rank still finding it, or already past it but still tearing down the interpreter
(seconds under load), died of the SIGTERM and was reported as `exitcode: -15` in about half the
2-process runs. So a refusing rank

  - handles SIGTERM from the moment it refuses: it exits 2, as it was about to;
  - waits, a bounded time, until every rank of the launch has refused too, counted in the agent's
    store (the TCPStore at MASTER_ADDR:MASTER_PORT that torchrun serves to its workers), so no rank
    exits while another is still on its way to the same refusal.

A rank that never refuses (it failed otherwise, or waits in a collective for this one) costs the
refusing ranks at most `WAIT_SECONDS`; the launcher then stops it as before.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

WAIT_SECONDS = 60.0
REFUSALS_KEY = "sft_recipes/refusing_ranks"


def exit_code_on_sigterm(code: int) -> None:
    """From now on, a SIGTERM ends this process with `code` at once (the refusal is already printed)."""
    if threading.current_thread() is threading.main_thread():  # the only thread that may set handlers
        signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(code))


def wait_for_every_rank_to_refuse(wait_seconds: float = WAIT_SECONDS) -> None:
    """Count this rank as refusing in the launcher's store; return once every rank is, or after `wait_seconds`."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return  # one process, or no store served by a launcher that outlives the ranks
    import torch.distributed as dist  # here: a refusal at parse time has not needed torch.distributed yet

    deadline = time.monotonic() + wait_seconds
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=10))
        key = f"{REFUSALS_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"  # one count per attempt
        refusing = store.add(key, 1)
        while refusing < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
            refusing = store.add(key, 0)
    except (RuntimeError, OSError, KeyError, ValueError):
        return  # no store to count in: exit now, as before
