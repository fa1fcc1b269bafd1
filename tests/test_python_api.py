"""`sft_recipes.train()` in processes a decorator started, and the AI Runtime retry with an injected MLFLOW_RUN_ID.

One module-scoped set of runs feeds every test:
- in-process: 2 torch.multiprocessing workers (the stand-in for `@distributed`), each calling train() four
  times in the same process: a run, a layout the world size cannot run (refused at lint), a data refusal
  after the process group exists, and the first run again in another output_dir;
- the runtime's retry: `accelerate launch` of the same recipe into an MLflow run created beforehand (as
  AI Runtime creates it and injects MLFLOW_RUN_ID), SIGKILLed after its first checkpoint, then the same
  command again on the same output_dir.
train() and `accelerate launch` then agree step for step: the launch's first attempt (its losses in the
injected run) and its retry (run_summary.json) both give train()'s losses.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import time

import pytest

from conftest import CPU_CONFIG, TINY_LLAMA_RECIPE, assert_resume_reproduces, free_port, read_summary
from fault_helpers import Run, complete, launch_with_faults, start_run, wait_for, worker_pid
from in_process_worker import outcomes, run_in_processes

pytestmark = pytest.mark.fsdp

STEPS, SAVE_EVERY = 4, 2
EXPERIMENT = "air-multinode-llama-sft"  # the tiny recipe's mlflow_experiment_name (= the workload's experiment_name)
COMMON = {"max_steps": STEPS, "save_steps": SAVE_EVERY, "sample_prompts": []}
WORKER_TIMEOUT = 600  # seconds: a rank left waiting in a collective would be killed here, and the test fails


@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_api")
    calls = [
        dict(recipe=str(TINY_LLAMA_RECIPE), accelerate_config=str(CPU_CONFIG), output_dir=str(root / "first"),
             **COMMON),
        dict(recipe=str(TINY_LLAMA_RECIPE), accelerate_config=str(CPU_CONFIG), output_dir=str(root / "layout"),
             pack_blocks=True, sequence_parallel_size=4, **COMMON),
        dict(recipe=str(TINY_LLAMA_RECIPE), accelerate_config=str(CPU_CONFIG), output_dir=str(root / "data"),
             max_length=64, overlong_policy="drop", **COMMON),
        dict(recipe=str(TINY_LLAMA_RECIPE), output_dir=str(root / "again"), **COMMON),  # the header's config
    ]
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    codes = run_in_processes(calls, root, free_port(), env=env, timeout=WORKER_TIMEOUT)
    return {"root": root, "codes": codes, "seconds": time.monotonic() - started,
            "ranks": outcomes(root) if codes == [0, 0] else None, "store": root / "mlflow.db"}


def create_injected_run(store) -> str:
    """What AI Runtime does before the command starts: a run in the workload's experiment, its id in MLFLOW_RUN_ID."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{store}")
    return client.create_run(client.create_experiment(EXPERIMENT)).info.run_id


def launch_arguments(output_dir) -> tuple[str, ...]:
    return ("--max_steps", str(STEPS), "--save_steps", str(SAVE_EVERY), "--sample_prompts", "[]",
            "--output_dir", str(output_dir))


def launch(output_dir, env: dict[str, str]) -> Run:
    """The workload's command on one node: `accelerate launch` of the recipe, slowed so a kill lands mid-run."""
    return start_run(*launch_arguments(output_dir), env={"FAULT_SLOW_STEP_SECONDS": "0.5", **env})


@pytest.fixture(scope="module")
def retried(tmp_path_factory):
    root = tmp_path_factory.mktemp("retry")
    store, output_dir = root / "mlflow.db", root / "run"
    run_id = create_injected_run(store)
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{store}", "MLFLOW_RUN_ID": run_id}

    first = launch(output_dir, env)
    wait_for(lambda: complete(output_dir / f"checkpoint-{SAVE_EVERY}"), first, f"checkpoint-{SAVE_EVERY}")
    # Preempted: every worker SIGKILLed (torchrun starts them in sessions of their own), then the launcher.
    workers = [worker_pid(first, rank) for rank in (0, 1)]
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    first.kill()
    first.wait()
    assert not (output_dir / "run_summary.json").exists(), first.output[-3000:]

    # The runtime's retry: the same command, the same MLFLOW_RUN_ID. Nothing signals it, so it goes through the
    # warm launcher (the first attempt is the real `accelerate launch` whose workers are killed), unslowed.
    second = launch_with_faults(*launch_arguments(output_dir), env=env)
    assert second.returncode == 0, (second.stdout + second.stderr)[-6000:]
    return {"store": store, "output_dir": output_dir, "run_id": run_id, "killed": workers}


def test_train_under_a_decorator_stand_in_runs_fsdp2_and_returns_the_result(in_process):
    assert in_process["codes"] == [0, 0], f"workers exited {in_process['codes']} (None: hung, killed)"
    rank0, rank1 = (calls[0] for calls in in_process["ranks"])
    assert list(rank0["losses"]) == [str(step) for step in range(1, STEPS + 1)]
    assert rank1["losses"] == rank0["losses"]  # the logged loss is the mean over ranks, on every rank
    assert rank0["output_dir"] == rank1["output_dir"] == str(in_process["root"] / "first")
    assert rank0["export_check"] == rank1["export_check"] == "passed"
    summary = read_summary(in_process["root"] / "first")
    assert summary["distributed"] == "FSDP2 over 2 process(es) on cpu"  # the config's FSDP2 plugin, applied
    assert summary["losses"] == rank0["losses"]
    assert summary["overrides"]["keyword_arguments"]["max_steps"] == STEPS
    assert rank0["has_summary"] and not rank1["has_summary"]
    # Rank 0 logged into one MLflow run and returned its id; the other rank has none.
    db = sqlite3.connect(in_process["store"])
    runs = [row[0] for row in db.execute("select run_uuid from runs")]
    assert rank0["mlflow_run_id"] in runs and rank1["mlflow_run_id"] is None


def test_a_refusal_raises_on_every_rank_and_no_rank_hangs(in_process):
    assert in_process["codes"] == [0, 0], f"workers exited {in_process['codes']} (None: hung, killed)"
    for calls in in_process["ranks"]:
        layout, data = calls[1]["refused"], calls[2]["refused"]
        assert "sequence_parallel_size=4 must divide the world size 2; use one of [1, 2]" in layout
        assert "more than max_dropped_share=0.05" in data  # met after the process group and the tokenizer exist
    assert not (in_process["root"] / "layout").exists()


def test_nothing_is_left_behind_and_a_second_call_trains_the_same(in_process):
    assert in_process["codes"] == [0, 0], f"workers exited {in_process['codes']} (None: hung, killed)"
    for calls in in_process["ranks"]:
        for call in calls:
            assert call["left_behind"] == {"process_group": False, "accelerate_state": False, "env": []}
        first, again = calls[0], calls[3]
        assert list(again["losses"]) == list(first["losses"])
        for step, loss in first["losses"].items():  # same seed, same data: any leaked state would show here
            assert again["losses"][step] == pytest.approx(loss, abs=1e-6), step
    assert read_summary(in_process["root"] / "again")["distributed"] == "FSDP2 over 2 process(es) on cpu"


def test_a_killed_run_retried_by_the_same_command_resumes_exactly(in_process, retried):
    assert all(retried["killed"])
    resumed = read_summary(retried["output_dir"])
    checkpoint_step = int(resumed["resumed_from"].rsplit("-", 1)[1])
    assert checkpoint_step >= SAVE_EVERY
    # Its later losses are those of the uninterrupted train() run, step for step.
    assert_resume_reproduces(in_process["root"] / "first", retried["output_dir"], checkpoint_step, atol=1e-4)


def test_the_injected_mlflow_run_gets_both_attempts_and_no_other_run_exists(in_process, retried):
    db = sqlite3.connect(retried["store"])
    assert [row[0] for row in db.execute("select run_uuid from runs")] == [retried["run_id"]]
    assert read_summary(retried["output_dir"])["mlflow_run_id"] == retried["run_id"]
    assert db.execute("select status from runs").fetchone()[0] == "FINISHED"
    logged = db.execute("select step, value from metrics where run_uuid = ? and key = 'loss' order by step",
                        (retried["run_id"],)).fetchall()
    reference = in_process["ranks"][0][0]["losses"]  # train()'s uninterrupted run
    checkpoint_step = int(read_summary(retried["output_dir"])["resumed_from"].rsplit("-", 1)[1])
    first_attempt = [step for step, _ in logged if step <= checkpoint_step]
    assert first_attempt and set(range(checkpoint_step + 1, STEPS + 1)) <= {step for step, _ in logged}
    for step, value in logged:  # `accelerate launch` (both attempts) and train() trained the same model
        assert value == pytest.approx(reference[str(step)], abs=1e-4), step
    params = dict(db.execute("select key, value from params where run_uuid = ?", (retried["run_id"],)))
    assert params["recipe.model_name_or_path"] == "tiny:llama" and int(params["max_steps"]) == STEPS
    tags = dict(db.execute("select key, value from tags where run_uuid = ?", (retried["run_id"],)))
    assert '"max_steps": 4' in tags["overrides.command_line"]
