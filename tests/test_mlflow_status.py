"""A failed attempt's MLflow run ends FAILED or KILLED, not FINISHED (MLflow's exit hook ends any active run as
FINISHED): an injected MLFLOW_RUN_ID on AI Runtime showed a crashed or preempted attempt as a finished run."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import REPO_ROOT
from sft_recipes.errors import RecipeError
from sft_recipes.reporting.mlflow_status import mlflow_run_ended_by_outcome, status_of

ATTEMPT = """
import mlflow, sys
from sft_recipes.reporting.mlflow_status import mlflow_run_ended_by_outcome
mlflow.start_run()  # the injected MLFLOW_RUN_ID, resumed as transformers' MLflowCallback resumes it
mlflow.log_metric("loss", 6.2, step=1)
with mlflow_run_ended_by_outcome():
    {ending}
"""


def injected_run(store) -> tuple:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{store}")
    return client, client.create_run(client.create_experiment("air-multinode-llama-sft")).info.run_id


def attempt(store, run_id: str, ending: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", ATTEMPT.format(ending=ending)], capture_output=True, text=True,
                          check=False, cwd=REPO_ROOT, env={"PYTHONPATH": str(REPO_ROOT / "src"), "MLFLOW_RUN_ID": run_id,
                                                           "MLFLOW_TRACKING_URI": f"sqlite:///{store}"})


def test_each_way_an_attempt_ends_has_its_status():
    assert [status_of(error) for error in (None, SystemExit(0), SystemExit(75), SystemExit(2), RecipeError("bad"),
                                           RuntimeError("NCCL"), KeyboardInterrupt())] == [
        "FINISHED", "FINISHED", "KILLED", "FAILED", "FAILED", "FAILED", "KILLED"]


@pytest.mark.slow
def test_a_preempted_attempt_leaves_the_injected_run_killed_not_finished(tmp_path):
    """In a process of its own: what ends the run otherwise is MLflow's exit hook, as FINISHED."""
    client, run_id = injected_run(tmp_path / "mlflow.db")
    preempted = attempt(tmp_path / "mlflow.db", run_id, "raise SystemExit(75)")  # the preemption stop's exit
    assert preempted.returncode == 75, preempted.stderr[-2000:]
    run = client.get_run(run_id)
    assert (run.info.status, run.data.metrics["loss"]) == ("KILLED", 6.2)


def test_a_run_that_returns_is_left_to_mlflow_one_that_raises_fails(tmp_path, monkeypatch):
    import mlflow

    client, run_id = injected_run(tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.start_run(run_id=run_id)
    try:
        with mlflow_run_ended_by_outcome():
            pass
        assert mlflow.active_run().info.run_id == run_id  # still active: MLflowCallback / the exit hook end it
    finally:
        mlflow.end_run()
    for error in (RecipeError("a refusal mid-run"), RuntimeError("NCCL watchdog timeout")):
        mlflow.start_run(run_id=run_id)
        with pytest.raises(type(error)), mlflow_run_ended_by_outcome():
            raise error
        assert mlflow.active_run() is None and client.get_run(run_id).info.status == "FAILED"


@pytest.mark.parametrize("users_own", [None, "5"])
def test_every_step_logged_asynchronously_reaches_the_store_when_the_run_ends(tmp_path, monkeypatch, users_own):
    """configure_mlflow makes MLflow's logging thread buffer (MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS), so that
    `end_run` wakes it instead of waiting out its 1 s poll for the next metric (timed in
    benchmarks/startup_time_2026-12-06.md); a user's own value is kept, and nothing logged is lost."""
    import mlflow
    from mlflow import MlflowClient

    from sft_recipes.reporting.tracking import configure_mlflow

    # Set (so recorded) before deleted: monkeypatch restores only what it changed, and configure_mlflow (and MLflow's
    # set_experiment) set the unset ones, which would stay in the pytest process (a later run would log to "sft-async")
    for name in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID",
                 "MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    if users_own is not None:
        monkeypatch.setenv("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", users_own)
    configure_mlflow(SimpleNamespace(report_to=["mlflow"]), "sft-async")
    assert os.environ["MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS"] == (users_own or "1")
    mlflow.set_experiment("sft-async")
    run_id = mlflow.start_run().info.run_id
    for step in range(1, 4):  # as transformers' MLflowCallback logs each step
        mlflow.log_metrics({"loss": 6.0 - step}, step=step, synchronous=False)
    mlflow.end_run()
    history = MlflowClient().get_metric_history(run_id, "loss")
    assert sorted((metric.step, metric.value) for metric in history) == [(1, 5.0), (2, 4.0), (3, 3.0)]
