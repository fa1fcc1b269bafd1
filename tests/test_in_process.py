"""sft_recipes.in_process without training: the launch environment is accelerate launch's own, the world the
caller started is checked, what a call changes in the process is undone; and an injected MLFLOW_RUN_ID that
MLflow would refuse late is refused at start (reporting/tracking.py)."""

from __future__ import annotations

import json
import logging
import os
import sys
from types import SimpleNamespace

import pytest

from conftest import CPU_CONFIG, REPO_ROOT, bin_path, free_port, run_command
from sft_recipes.errors import RecipeError
from sft_recipes.in_process import accelerate_launch_environment, caller_world, in_process_launch
from sft_recipes.reporting.tracking import check_injected_mlflow_run

GPU_CONFIG = REPO_ROOT / "accelerate_configs" / "fsdp2_8gpu.yaml"
EXPORTED_PREFIXES = ("ACCELERATE_", "FSDP_")


def test_the_environment_is_what_accelerate_launch_exports(tmp_path):
    dump = tmp_path / "dump_env.py"
    dump.write_text("import json, os, sys\n"
                    f"open(os.path.join({str(tmp_path)!r}, 'env' + os.environ['RANK'] + '.json'), 'w')"
                    ".write(json.dumps(dict(os.environ)))\n")
    result = run_command([bin_path("accelerate"), "launch", "--config_file", str(CPU_CONFIG),
                          "--main_process_port", str(free_port()), str(dump)], timeout=120, launcher="real")
    assert result.returncode == 0, result.stderr[-3000:]
    launched = json.loads((tmp_path / "env0.json").read_text())
    launched = {name: value for name, value in launched.items() if name.startswith(EXPORTED_PREFIXES)}
    launched = {name: value for name, value in launched.items() if not name.startswith("ACCELERATE_DYNAMO_")}
    assert accelerate_launch_environment(CPU_CONFIG, world_size=2) == launched  # dynamo: unset reads as off
    assert launched["ACCELERATE_USE_FSDP"] == "true" and launched["FSDP_VERSION"] == "2"


def test_the_gpu_config_exports_fsdp2_bf16_and_activation_checkpointing():
    ours = accelerate_launch_environment(GPU_CONFIG, world_size=8)
    assert (ours["ACCELERATE_USE_FSDP"], ours["FSDP_VERSION"], ours["ACCELERATE_MIXED_PRECISION"],
            ours["FSDP_ACTIVATION_CHECKPOINTING"]) == ("true", "2", "bf16", "true")


def test_a_world_the_config_was_not_made_for_is_one_refusal():
    with pytest.raises(RecipeError) as err:
        accelerate_launch_environment(GPU_CONFIG, world_size=16)
    assert str(err.value) == (f"{GPU_CONFIG} launches 8 processes (num_processes) but train() runs in a world of 16 "
                              "(WORLD_SIZE): start 8 processes (e.g. gpus=8), or pass the accelerate config made "
                              "for 16.")


def test_a_partial_rendezvous_is_refused(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert caller_world() == (0, 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RecipeError, match="without LOCAL_RANK, MASTER_ADDR, MASTER_PORT: start it with all of"):
        caller_world()


def test_a_call_leaves_the_environment_logging_and_mlflow_run_id_as_mlflow_would(monkeypatch, tmp_path):
    from sft_recipes.reporting import console

    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "1"}.items():  # rank 0 of the config's 2
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("sft_recipes.in_process._start_process_group", lambda rank, world_size: None)  # no peer
    monkeypatch.setenv("MLFLOW_RUN_ID", "injected")
    monkeypatch.setenv("KEPT", "before")
    root = logging.getLogger()
    handlers = list(root.handlers)
    stdout, stderr = sys.stdout, sys.stderr
    with in_process_launch(CPU_CONFIG):
        assert os.environ["ACCELERATE_USE_FSDP"] == "true"
        console.open_train_log(tmp_path / "run")  # what start_run does: tee the console into train.log
        console.keep_train_log()
        assert sys.stdout is not stdout
        os.environ["FSDP_TRANSFORMER_CLS_TO_WRAP"] = "LlamaDecoderLayer"  # what fsdp_wrap.py sets in a run
        os.environ["KEPT"] = "changed"
        del os.environ["MLFLOW_RUN_ID"]  # what mlflow.start_run does with it
    assert not [name for name in os.environ if name.startswith(EXPORTED_PREFIXES)]
    assert os.environ["KEPT"] == "before" and "MLFLOW_RUN_ID" not in os.environ
    assert root.handlers == handlers
    assert (sys.stdout, sys.stderr) == (stdout, stderr) and not console._TRAIN_LOG  # the next run logs alone
    print("after the call")
    assert "after the call" not in (tmp_path / "run" / "train.log").read_text()
    with in_process_launch(CPU_CONFIG):  # a run that never reached MLflow leaves the id for the next call
        pass
    assert "MLFLOW_RUN_ID" not in os.environ  # (consumed above)
    monkeypatch.setenv("MLFLOW_RUN_ID", "injected")
    with pytest.raises(RecipeError):
        with in_process_launch(CPU_CONFIG):
            raise RecipeError("refused")
    assert os.environ["MLFLOW_RUN_ID"] == "injected"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("workload-experiment")).info.run_id
    return uri, run_id


MLFLOW_ARGS = SimpleNamespace(report_to=["mlflow"])


def test_an_injected_run_of_the_store_passes_and_a_different_recipe_experiment_is_said(store, monkeypatch, caplog):
    uri, run_id = store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    with caplog.at_level(logging.WARNING, logger="sft"):
        check_injected_mlflow_run(MLFLOW_ARGS, "workload-experiment", is_main=True)
        assert not caplog.records
        check_injected_mlflow_run(MLFLOW_ARGS, "recipe-experiment", is_main=True)
    assert "the recipe's mlflow_experiment_name 'recipe-experiment' is not used" in caplog.text
    assert f"MLFLOW_RUN_ID={run_id} of experiment 'workload-experiment'" in caplog.text


def test_an_injected_run_mlflow_would_refuse_late_is_refused_now(store, monkeypatch):
    uri, run_id = store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_RUN_ID", "0" * 32)
    with pytest.raises(RecipeError, match=f"MLFLOW_RUN_ID={'0' * 32} is not a run of the MLflow store {uri}"):
        check_injected_mlflow_run(MLFLOW_ARGS, None, is_main=True)
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "elsewhere")
    with pytest.raises(RecipeError, match="is a run of experiment 'workload-experiment' but MLFLOW_EXPERIMENT_NAME is "
                                          "'elsewhere'"):
        check_injected_mlflow_run(MLFLOW_ARGS, None, is_main=True)
    check_injected_mlflow_run(SimpleNamespace(report_to=["none"]), None, is_main=True)  # no MLflow: nothing to check
