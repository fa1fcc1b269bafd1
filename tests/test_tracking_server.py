"""An MLflow tracking server (`MLFLOW_TRACKING_URI=http(s)://...`) that does not answer is refused before anything
loads, in one request without MLflow's retries (7, with backoff: a run against a stopped server took 4 min 25 s,
then a traceback at the first step). A server that answers as MLflow does is used as before."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest

from conftest import TINY_LLAMA_RECIPE, an_http_server, free_port, launch_sft
from fault_helpers import rank_exit_codes
from sft_recipes.errors import RecipeError
from sft_recipes.preflight_launch import recipe_refusal
from sft_recipes.reporting.tracking import refuse_a_tracking_server_that_does_not_answer

MLFLOW_RUN = SimpleNamespace(report_to=["mlflow"])
FIX = ("start it or fix MLFLOW_TRACKING_URI (and MLFLOW_TRACKING_TOKEN, or _USERNAME and _PASSWORD), unset it to log "
       "to the local ./mlruns.db, or pass --report_to none.")


def test_a_server_that_answers_as_mlflow_passes_with_one_request(monkeypatch):
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "77")  # the user's own, for MLflow's logging
    not_there = {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "Could not find experiment with name 'sft-x'"}
    with an_http_server(404, not_there) as (uri, asked):  # what MLflow answers for an experiment not yet made
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        refuse_a_tracking_server_that_does_not_answer(MLFLOW_RUN, "sft-x")
    assert asked == ["/api/2.0/mlflow/experiments/get-by-name?experiment_name=sft-x"]
    # the check's single try is its own: MLflow's logging gets the environment back as it was
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ and os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "77"


def test_a_server_that_refuses_the_request_is_one_line_after_one_request(monkeypatch):
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team-runs")  # the name MLflow's logging will ask for
    no_credentials = {"error_code": "UNAUTHENTICATED", "message": "You are not authenticated."}
    with an_http_server(401, no_credentials) as (uri, asked):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        with pytest.raises(RecipeError) as err:
            refuse_a_tracking_server_that_does_not_answer(MLFLOW_RUN, "sft-x")
    assert str(err.value) == (f"MLFLOW_TRACKING_URI={uri} does not answer as an MLflow tracking server "
                              f"(UNAUTHENTICATED: You are not authenticated.): {FIX}")
    assert asked == ["/api/2.0/mlflow/experiments/get-by-name?experiment_name=team-runs"]


@pytest.mark.parametrize("status", [429, 503])
def test_a_busy_server_is_left_to_mlflows_own_retries_after_one_request(status, monkeypatch, caplog):
    with an_http_server(status, {}) as (uri, asked), caplog.at_level(logging.WARNING, logger="sft"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        refuse_a_tracking_server_that_does_not_answer(MLFLOW_RUN, "sft-x")  # not refused: it is there, perhaps busy
    assert len(asked) == 1  # MLflow's client alone would have asked 8 times
    assert caplog.messages == [f"MLFLOW_TRACKING_URI={uri} answered 429 or 5xx (busy or unavailable) to the check's "
                               "request; MLflow's logging retries such answers itself (7 times, ~4 min)"]


def test_a_stopped_server_is_refused_without_a_request_and_a_local_store_is_not_asked(monkeypatch, tmp_path):
    port = free_port()  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    line = (f"MLFLOW_TRACKING_URI=http://127.0.0.1:{port} does not answer as an MLflow tracking server (no connection "
            f"to 127.0.0.1:{port}: Connection refused): {FIX}")
    with pytest.raises(RecipeError, match="^MLFLOW") as err:
        refuse_a_tracking_server_that_does_not_answer(MLFLOW_RUN, "sft-x")
    assert str(err.value) == line
    # The launch pre-check (make train, launch_multinode.sh) refuses it before any process starts
    assert recipe_refusal("accelerate_configs/fsdp2_cpu.yaml", str(TINY_LLAMA_RECIPE), ["--report_to", "mlflow"], None,
                          has_accelerator=False) == line
    assert recipe_refusal("accelerate_configs/fsdp2_cpu.yaml", str(TINY_LLAMA_RECIPE), ["--report_to", "none"], None,
                          has_accelerator=False) is None
    refuse_a_tracking_server_that_does_not_answer(SimpleNamespace(report_to=[]), "sft-x")  # not reported to MLflow
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlruns.db'}")  # a local store: nothing to ask
    refuse_a_tracking_server_that_does_not_answer(MLFLOW_RUN, "sft-x")
    assert not (tmp_path / "mlruns.db").exists()


@pytest.mark.fsdp
def test_every_rank_refuses_a_stopped_tracking_server_before_loading(tmp_path):
    port = free_port()
    result = launch_sft(TINY_LLAMA_RECIPE, "--report_to", "mlflow", "--output_dir", str(tmp_path / "out"),
                        env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}"}, check=False)
    assert rank_exit_codes(result.stderr) == {0: 2, 1: 2}, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: MLFLOW_TRACKING_URI=http://127.0.0.1:{port} does not answer as an MLflow tracking server "
                      f"(no connection to 127.0.0.1:{port}: Connection refused): {FIX}"]
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["train.log"]  # nothing loaded, nothing written
