"""Refusals a user can fix print one `error:` line and exit 2; only bugs print a traceback.

Every check of user input (the recipe, its data, its output_dir, the launcher's setup) raises
`RecipeError` with a message that names the problem and ends with the fix. `one_line_refusals` turns
it into that one line, printed once (by the process of rank 0, or by the only process), and exit
status 2 on every rank: the ranks of a distributed run meet the same refusal, so none is left
waiting, and each waits for the others before it exits, so the launcher stops none of them first
(`sft_recipes.refusal_exit`). Every rank's line also goes to the run's train.log once the run has one
(`on_refusal`, `reporting.console.open_train_log`): torchrun's ChildFailedError report comes after
ours, so the log (or the first `error:` line of the console) is where a refusal made inside the run is read.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from sft_recipes.refusal_exit import refusing_together

REFUSED_EXIT_CODE = 2
_REFUSAL_HOOKS: list[Callable[[str], None]] = []  # e.g. train.log's: called with the `error:` line once printed


class RecipeError(ValueError):
    """Bad input a user can fix; the message lists every problem found, each with its fix."""


def on_refusal(hook: Callable[[str], None]) -> None:
    """From now on `hook` gets this process's `error:` line when it refuses (one hook: the run's train.log)."""
    _REFUSAL_HOOKS[:] = [hook]


def forget_refusal_hooks() -> None:
    _REFUSAL_HOOKS.clear()


def one_line_refusals(main: Callable[[], int]) -> int:
    """Run `main`; a RecipeError becomes one `error: ...` line on stderr (rank 0 only) and exit code 2.

    Call it outside anything that still writes on the way out (e.g. the process group's teardown), so
    that the line is the last thing the process writes."""
    try:
        return main()
    except RecipeError as err:
        return refuse(str(err))


def refuse(problem_and_fix: str) -> int:
    """Print `error: <problem_and_fix>` (rank 0's) and return the exit code, once every rank refused too."""
    with refusing_together(REFUSED_EXIT_CODE):  # no rank is stopped by the launcher before it exits 2
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{_end_an_open_progress_bar()}error: {problem_and_fix}", file=sys.stderr, flush=True)
        for hook in _REFUSAL_HOOKS:
            hook(f"error: {problem_and_fix}")
    return REFUSED_EXIT_CODE


def _end_an_open_progress_bar() -> str:
    """A newline when a progress bar is still open (its line ends in a carriage return, not a newline), so that the
    `error:` line stands on a line of its own; nothing otherwise, so that it follows the last line directly."""
    tqdm_module = sys.modules.get("tqdm")  # no tqdm imported: no bar drawn
    if tqdm_module is None:
        return ""
    open_bars = getattr(tqdm_module.tqdm, "_instances", None)  # every tqdm subclass's bars (datasets', Trainer's)
    return "\n" if open_bars is None or len(open_bars) else ""
