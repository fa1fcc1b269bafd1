"""How a script's process ends: as the interpreter ends it, less the teardown of everything it imported.

When a script's main returns, the interpreter joins the threads that are not daemons (and the workers of
`concurrent.futures` executors), runs the atexit handlers (logging's, MLflow's, `weakref.finalize`'s), flushes
stdout and stderr, and then finalizes: it clears every module and collects every object still alive. In a
process that imported torch, transformers, TRL and datasets (~475,000 objects tracked by gc) that last part
costs ~1.3 s of CPU, in every process of every run (measured in benchmarks/startup_time_2026-12-06.md). Python
does not promise to call `__del__` on what is alive at exit, and nothing a run writes waits for it: every file is
closed or flushed before (train.log line by line, through stdout's tee).

`run_then_exit` does the first three steps as the interpreter does them and then ends the process with
`os._exit`, as multiprocessing's forked children (torch's DataLoader workers among them) end. Only a clean end
takes this way: a return or a `SystemExit` with a status (a refusal's 2, a preemption's 75). An uncaught exception
leaves through the interpreter, which prints its traceback and exits 1 as before. Ranks that end sooner must not
leave before a rank that still has a line to print: see `refusal_exit`.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

# The interpreter's status when flushing stdout or stderr fails at exit (Python/pylifecycle.c: Py_RunMain)
FLUSH_FAILED_EXIT_CODE = 120


def run_then_exit(main: Callable[[], int | None]) -> NoReturn:
    """`sys.exit(main())`, without the interpreter's finalization when main ends cleanly."""
    try:
        code = main()
    except SystemExit as stop:
        if not isinstance(stop.code, (int, type(None))):  # sys.exit("message"): the interpreter prints it
            raise
        code = stop.code
    exit_like_the_interpreter(code or 0)


def exit_like_the_interpreter(code: int) -> NoReturn:
    # threading._shutdown is what Py_FinalizeEx calls first: it runs threading's own exit hooks (executors stop
    # their workers there) and joins every non-daemon thread; joining them by hand would wait forever on idle workers
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: the interpreter reports that with 120
            code = code or FLUSH_FAILED_EXIT_CODE
    os._exit(code)
