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
    exits while another is still on its way to the same refusal;
  - then ignores SIGTERM while it exits: at interpreter finalization Python resets signals that
    have Python handlers to the default action, so a SIGTERM during the teardown (the -15 that
    remained with the two steps above) killed it anyway; an ignored signal is left ignored.

A rank that never refuses (it failed otherwise, or waits in a collective for this one) costs the
refusing ranks at most `WAIT_SECONDS`; the launcher then stops it as before.

The non-finite stop (`fault.nonfinite`: every rank stops at the same step, rank 0 prints one `error:` line, exit 1)
leaves the same way: once ranks skip the interpreter's teardown (`script_exit`), a rank with nothing to print
exited first and torchrun stopped rank 0 before its line was out.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

WAIT_SECONDS = 60.0
REFUSALS_KEY = "sft_recipes/refusing_ranks"


@contextlib.contextmanager
def refusing_together(exit_code: int) -> Iterator[None]:
    """Around printing a refusal: on a rank of a launched run, SIGTERM exits `exit_code` from now on, and the
    rank leaves once every rank has refused (or after WAIT_SECONDS). One process: nothing changes."""
    if not _launched():
        yield
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(exit_code))
    yield
    wait_for_every_rank_to_refuse()
    # Python puts the default action back for signals it handles when the interpreter finalizes, and tearing
    # down torch takes seconds under load: a SIGTERM then would still be a -15. An ignored signal stays ignored.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _launched() -> bool:
    """A rank of a multi-process launch whose launcher serves the store and outlives the ranks (torchrun's agent)."""
    return (int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and threading.current_thread() is threading.main_thread())  # the only thread that may set handlers


def wait_for_every_rank_to_refuse(wait_seconds: float = WAIT_SECONDS) -> None:
    """Count this rank as refusing in the launcher's store; return once every rank is, or after `wait_seconds`."""
    import torch.distributed as dist  # here: a refusal at parse time has not needed torch.distributed yet

    world_size = int(os.environ["WORLD_SIZE"])
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
