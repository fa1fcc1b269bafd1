"""The MLflow run's status says how the attempt ended: FAILED or KILLED, not FINISHED.

MLflow ends an active run at interpreter exit (`atexit`) as FINISHED whatever the exit, and transformers'
MLflowCallback does the same when it is collected. So an attempt that crashed, refused mid-run, or stopped for
preemption (SIGTERM: a checkpoint, then exit 75; also what torchrun sends the other ranks when one rank dies)
showed in the MLflow UI as a finished run until a retry resumed it (an injected MLFLOW_RUN_ID on AI Runtime:
one run for every attempt). Here the run is ended first, with the status of how the process is ending:
KILLED for a preemption stop or an interrupt, FAILED for anything else. A SIGKILL of rank 0 itself runs no code: its run
stays RUNNING until the retry (docs/ai-runtime.md).

mlflow is imported only when the run already did (a run without MLflow never loads it).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


def status_of(error: BaseException | None) -> str:
    """MLflow's RunStatus name for a process that ends with `error` (None: it returned)."""
    from sft_recipes.fault.preemption import REQUEUE_EXIT_CODE  # here: the script's start stays light

    if error is None or (isinstance(error, SystemExit) and error.code in (0, None)):
        return "FINISHED"
    if isinstance(error, KeyboardInterrupt) or (isinstance(error, SystemExit) and error.code == REQUEUE_EXIT_CODE):
        return "KILLED"  # stopped from outside: preempted (a checkpoint, exit 75) or interrupted
    return "FAILED"


def end_active_mlflow_run(error: BaseException | None) -> None:
    """End this process's active MLflow run (if any) with the status `error` gives it."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and mlflow.active_run() is not None:
        mlflow.end_run(status=status_of(error))


@contextlib.contextmanager
def mlflow_run_ended_by_outcome() -> Iterator[None]:
    """Around a run's main: an exception (a refusal, a crash, the preemption exit) ends the active MLflow run as
    FAILED or KILLED before it propagates; a normal return leaves the run to MLflow (FINISHED)."""
    try:
        yield
    except BaseException as error:
        end_active_mlflow_run(error)
        raise
