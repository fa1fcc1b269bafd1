"""MLflow out of the box: a local store by default, managed-platform variables honoured, no secrets.

transformers' MLflowCallback does the logging (rank 0 only) and reads MLFLOW_TRACKING_URI,
MLFLOW_EXPERIMENT_NAME and MLFLOW_RUN_ID; we only give them defaults and add the recipe's own keys.

An injected MLFLOW_RUN_ID (Databricks AI Runtime creates the run in the workload's experiment_name and
sets it, with a Databricks tracking URI; a retry of the workload gets the same one): rank 0 logs into
that run, and `mlflow.start_run` resumes it (status back to RUNNING) -- no second run. Two traps,
checked by `check_injected_mlflow_run` before anything loads, on every rank:
- transformers calls `mlflow.set_experiment(MLFLOW_EXPERIMENT_NAME)` before `start_run`, and MLflow
  refuses to resume a run of another experiment ("active experiment ID does not match environment run
  ID") -- at the first step, after the model loaded. So with a run id the recipe's
  mlflow_experiment_name is not exported (the run's experiment wins, said on rank 0 when they differ),
  and an MLFLOW_EXPERIMENT_NAME that names another experiment is refused;
- a run id the store does not hold (or a deleted run) failed the same late way; refused now.
A retry re-logs the steps after its checkpoint (MLflow keeps both values of those steps), and a
param must keep its value in one run: what a retry may change is logged as tags (summary.py).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from transformers import TrainerCallback

from sft_recipes import network
from sft_recipes.data.report import DataReport, MixtureReport
from sft_recipes.errors import RecipeError

logger = logging.getLogger("sft")

DEFAULT_STORE = "mlruns.db"
ASYNC_LOGGING_BUFFER_SECONDS = 1  # a step's metrics reach the store within this, in one batch with the steps beside it
SECRET_ENV_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "DATABRICKS_TOKEN", "MLFLOW_TRACKING_TOKEN")


def mlflow_enabled(training_args) -> bool:
    return "mlflow" in (training_args.report_to or [])


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI, else the local sqlite store in the working directory."""
    # The skinny client reads a local sqlite store (with sqlalchemy + alembic); the plain file
    # store is deprecated and refused unless MLFLOW_ALLOW_FILE_STORE is set.
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(DEFAULT_STORE).resolve()}"


def configure_mlflow(training_args, experiment_name: str | None) -> str | None:
    """Set default tracking URI / experiment in the environment; return the URI in use."""
    if not mlflow_enabled(training_args):
        return None
    os.environ["MLFLOW_TRACKING_URI"] = tracking_uri()
    # transformers logs each step's metrics asynchronously. MLflow's logging thread, when not told to buffer, waits for
    # the next metric with queue.get(timeout=1), so `end_run` waited up to 1 s at the end of every run. Buffering
    # waits on the stop event instead, which `end_run` sets: measured 1.01 s -> 0.02 s, every metric logged.
    os.environ.setdefault("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", str(ASYNC_LOGGING_BUFFER_SECONDS))
    if experiment_name and not os.environ.get("MLFLOW_RUN_ID"):  # an injected run's experiment wins
        os.environ.setdefault("MLFLOW_EXPERIMENT_NAME", experiment_name)
    return os.environ["MLFLOW_TRACKING_URI"]


# What a loaded tracking server may take to answer the check's one request; one that hangs costs a process this, once.
TRACKING_CHECK_TIMEOUT_S = 30


def refuse_a_tracking_server_that_does_not_answer(training_args, experiment_name: str | None) -> None:
    """An MLflow tracking server (an http(s) MLFLOW_TRACKING_URI) that does not answer, or refuses the request
    MLflow's logging makes first, is refused before anything loads. MLflow's client retries each request 7 times:
    a server that was down cost a run 4 min 25 s, then a traceback at the first step, after the model loaded."""
    if not mlflow_enabled(training_args):
        return
    uri = tracking_uri()
    if urlparse(uri).scheme not in ("http", "https"):
        return  # a local store, or Databricks' (its workspace's host and credentials)
    reason = network.unreachable(uri)
    if reason is None:
        from accelerate.utils import patch_environment
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        try:  # once (MLflow's default: 7 retries with backoff, each up to 120 s); both are read at each request
            with patch_environment(MLFLOW_HTTP_REQUEST_MAX_RETRIES=0,
                                   MLFLOW_HTTP_REQUEST_TIMEOUT=TRACKING_CHECK_TIMEOUT_S):
                # what transformers' MLflowCallback asks first (set_experiment)
                MlflowClient(uri).get_experiment_by_name(os.environ.get("MLFLOW_EXPERIMENT_NAME") or experiment_name
                                                         or "Default")
        except MlflowException as err:
            if answered_with_a_status_mlflow_retries(err):
                logger.warning("MLFLOW_TRACKING_URI=%s answered 429 or 5xx (busy or unavailable) to the check's "
                               "request; MLflow's logging retries such answers itself (7 times, ~4 min)", uri)
                return
            reason = err.message.splitlines()[0]
    if reason:
        raise RecipeError(f"MLFLOW_TRACKING_URI={uri} does not answer as an MLflow tracking server ({reason}): "
                          "start it or fix MLFLOW_TRACKING_URI (and MLFLOW_TRACKING_TOKEN, or _USERNAME and "
                          "_PASSWORD), unset it to log to the local ./mlruns.db, or pass --report_to none.")


def answered_with_a_status_mlflow_retries(err: Exception) -> bool:
    """429 or 5xx: requests' RetryError under MLflow's exception. The server is there, perhaps only busy."""
    import requests

    cause = err
    while cause is not None and not isinstance(cause, requests.exceptions.RetryError):
        cause = cause.__cause__ or cause.__context__
    return cause is not None


def check_injected_mlflow_run(training_args, experiment_name: str | None, is_main: bool) -> None:
    """With MLFLOW_RUN_ID set: refuse a run the store does not hold, or an MLFLOW_EXPERIMENT_NAME of another
    experiment; say (rank 0) when the recipe's mlflow_experiment_name is not the run's experiment."""
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if not run_id or not mlflow_enabled(training_args):
        return
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    uri = tracking_uri()
    client = MlflowClient(uri)
    try:
        run = client.get_run(run_id)
        experiment = client.get_experiment(run.info.experiment_id).name
    except MlflowException as err:
        raise RecipeError(f"MLFLOW_RUN_ID={run_id} is not a run of the MLflow store {uri} "
                          f"({err.message.splitlines()[0]}): unset MLFLOW_RUN_ID to start a new run, or set "
                          "MLFLOW_TRACKING_URI to the store that holds it.") from None
    if run.info.lifecycle_stage == "deleted":
        raise RecipeError(f"MLFLOW_RUN_ID={run_id} is a deleted run in {uri}: restore it, or unset MLFLOW_RUN_ID.")
    exported = os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if exported and exported != experiment:
        raise RecipeError(f"MLFLOW_RUN_ID={run_id} is a run of experiment '{experiment}' but MLFLOW_EXPERIMENT_NAME is "
                          f"'{exported}', and MLflow logs a run only in its own experiment: unset "
                          "MLFLOW_EXPERIMENT_NAME, or make it the run's (on AI Runtime: the workload's "
                          "experiment_name).")
    if is_main and experiment_name and experiment_name != experiment:
        logger.warning("MLflow: logging into MLFLOW_RUN_ID=%s of experiment '%s'; the recipe's mlflow_experiment_name "
                       "'%s' is not used (make the workload's experiment_name and the recipe's the same to silence "
                       "this)", run_id, experiment, experiment_name)


def redact(values: dict[str, Any]) -> dict[str, Any]:
    """Replace any value that contains a secret from the environment."""
    secrets = [os.environ[name] for name in SECRET_ENV_VARS if os.environ.get(name)]
    return {k: "<redacted>" if any(s in str(v) for s in secrets) else v for k, v in values.items()}


class RecipeParamsCallback(TrainerCallback):
    """Log the recipe's own keys (data/model/export settings) next to the TrainingArguments."""

    def __init__(self, recipe_values: dict[str, Any]):
        self.params = redact({f"recipe.{k}": str(v)[:250] for k, v in recipe_values.items()})

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and mlflow_enabled(args):
            import mlflow

            if mlflow.active_run() is not None:
                mlflow.log_params(self.params)


class DataReportCallback(TrainerCallback):
    """Write the report to output_dir/data_report.json; log its counts to MLflow as `data.*` params.

    Rows read while training (a packed stream's readers, a stream read unpacked) are counted as they
    are read: at the end the report is printed again and the file written again with those counts.
    """

    def __init__(self, report: DataReport | MixtureReport, counted_while_training: bool = False) -> None:
        self.report = report
        self.counted_while_training = counted_while_training  # a packed stream's drops: written again at the end

    def _write(self, args) -> dict:
        summary = self.report.as_dict()
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        Path(args.output_dir, "data_report.json").write_text(json.dumps(summary, indent=2, default=str))
        return summary

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.counted_while_training:
            print(f"[data] read while training:\n{self.report.format()}", flush=True)
            self._write(args)

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self._write(args)
        if not mlflow_enabled(args):
            return
        import mlflow

        if mlflow.active_run() is not None:
            mlflow.log_params(self.report.mlflow_params())
