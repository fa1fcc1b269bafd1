"""Refusals a user can fix print one `error:` line and exit 2; only bugs print a traceback.

Every check of user input (the recipe, its data, its output_dir, the launcher's setup) raises
`RecipeError` with a message that names the problem and ends with the fix. `one_line_refusals` turns
it into that one line, printed once (by the process of rank 0, or by the only process), and exit
status 2 on every rank: the ranks of a distributed run meet the same refusal, so none is left
waiting. Every rank also appends its line to the run's train.log once the run has one
(`reporting.console.open_train_log`): torchrun's ChildFailedError report comes after ours, so the
log (or the first `error:` line of the console) is where a refusal made inside the run is read.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

REFUSED_EXIT_CODE = 2
_REFUSAL_LOG: list[tuple[Path, int]] = []  # (train.log, this process's rank), once the run has one


class RecipeError(ValueError):
    """Bad input a user can fix; the message lists every problem found, each with its fix."""


def write_refusals_to(path: str | os.PathLike, rank: int) -> None:
    """From now on a refusal of this process is also appended to `path` (rank 0's goes there with its console)."""
    _REFUSAL_LOG[:] = [(Path(path), rank)]


def one_line_refusals(main: Callable[[], int]) -> int:
    """Run `main`; a RecipeError becomes one `error: ...` line on stderr (rank 0 only) and exit code 2.

    Call it outside anything that still writes on the way out (e.g. the process group's teardown), so
    that the line is the last thing the process writes."""
    try:
        return main()
    except RecipeError as err:
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0:
            # On a line of its own, even after a progress bar that ended with a carriage return and no newline.
            print(f"\nerror: {err}", file=sys.stderr, flush=True)
        for path, log_rank in _REFUSAL_LOG:
            if log_rank != 0 and path.parent.is_dir():  # rank 0's line reached the log with its console
                with open(path, "a", encoding="utf-8") as log:
                    log.write(f"[rank {log_rank}] error: {err}\n")
        return REFUSED_EXIT_CODE
