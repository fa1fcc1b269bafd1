"""Preemption, kill -9 during a save, and exact resume, on 2 CPU processes (FSDP2 over gloo).

One uninterrupted run is the reference. A second run in another output_dir is interrupted three
times and resumed with `resume_from_checkpoint: auto` each time:
  1. SIGTERM to rank 1 only: both ranks checkpoint at the next step boundary and exit 75;
  2. rank 1 is SIGKILLed in the middle of a save: the half-written checkpoint is never resumed from;
  3. SIGUSR1 to the launcher (as Slurm sends it): torchrun forwards it to every rank, same stop;
then it runs to the end. Its last losses must equal the reference run's: every resume was exact.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import time

import pytest

from conftest import REPO_ROOT, TINY_LLAMA_RECIPE, launch_sft, read_summary
from fault_helpers import complete, finish, rank_exit_codes, start_run, wait_for, worker_pid
from sft_recipes.fault.preemption import REQUEUE_EXIT_CODE

pytestmark = pytest.mark.fsdp

STEPS, SAVE_EVERY, KEEP = 8, 2, 2
COMMON = ("--max_steps", str(STEPS), "--save_steps", str(SAVE_EVERY), "--save_total_limit", str(KEEP))
SLOW = {"FAULT_SLOW_STEP_SECONDS": "0.25"}  # 0.5 s per optimizer step: room for a signal mid-run
ENV_TOKEN = "hf_ENVtokenSECRET0123456789abcdef"
FILE_TOKEN = "hf_FILEtokenSECRET0123456789abcdef"
PREEMPTED = re.compile(r"\[preempted\] stopped at step (\d+) of 8")


def stopped_step(output: str) -> int:
    match = PREEMPTED.search(output)
    assert match, output[-4000:]
    return int(match.group(1))


def next_save_after(step: int) -> int:
    return (step // SAVE_EVERY + 1) * SAVE_EVERY


def newest_two_checkpoints(last_stop: int) -> list[str]:
    """The two checkpoints completed last: the final run's saves, or its start and its one save."""
    return [f"checkpoint-{max(last_stop, STEPS - SAVE_EVERY)}", f"checkpoint-{STEPS}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fault")
    token_file = root / "hf_token"
    token_file.write_text(FILE_TOKEN)

    # Reference: uninterrupted, MLflow on, the HF token only in a token file (HF_TOKEN empty = unset).
    store = root / "mlflow.db"
    reference = launch_sft(TINY_LLAMA_RECIPE, *COMMON, "--output_dir", str(root / "reference"), env={
        "HF_TOKEN": "", "HF_TOKEN_PATH": str(token_file), "MLFLOW_TRACKING_URI": f"sqlite:///{store}"})

    out = root / "interrupted"
    overrides = (*COMMON, "--output_dir", str(out), "--report_to", "none")
    token_env = {"HF_TOKEN": ENV_TOKEN}
    outputs = {}

    # 1. SIGTERM to rank 1 once the first checkpoint is complete.
    run = start_run(*overrides, env={**SLOW, **token_env})
    wait_for(lambda: complete(out / f"checkpoint-{SAVE_EVERY}"), run, "the first checkpoint")
    os.kill(worker_pid(run, 1), signal.SIGTERM)
    outputs["sigterm"] = finish(run)
    first_stop = stopped_step(outputs["sigterm"].output)

    # 2. Resume; rank 1 dies in the middle of the next save.
    killed_save = next_save_after(first_stop)
    run = start_run(*overrides, env={"FAULT_KILL_IN_SAVE": f"1:{killed_save}", **token_env})
    outputs["kill"] = finish(run, watch_ranks=(0, 1))
    half_written_files = sorted(p.name for p in (out / f"checkpoint-{killed_save}").iterdir())

    # 3. Resume; SIGUSR1 to the launcher after the re-done save, forwarded to every rank.
    run = start_run(*overrides, env={**SLOW, **token_env,
                                     "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"})
    wait_for(lambda: complete(out / f"checkpoint-{killed_save}"), run, "the re-done checkpoint")
    os.kill(run.pid, signal.SIGUSR1)
    outputs["sigusr1"] = finish(run)
    second_stop = stopped_step(outputs["sigusr1"].output)

    # 4. Resume to the end with the plain script.
    final = launch_sft(TINY_LLAMA_RECIPE, *overrides, env=token_env)
    return {"root": root, "out": out, "store": store, "reference": reference, "outputs": outputs, "final": final,
            "first_stop": first_stop, "killed_save": killed_save, "second_stop": second_stop,
            "half_written_files": half_written_files}


def test_sigterm_on_one_rank_checkpoints_every_rank_and_exits_for_requeue(runs):
    result = runs["outputs"]["sigterm"]
    assert SAVE_EVERY <= runs["first_stop"] < STEPS
    assert "rank 1 got SIGTERM" in result.output and "rank 0 got" not in result.output
    # torchrun lists each worker's own exit code; both stopped cleanly with the requeue code (the SIGTERM
    # torchrun sends the second rank once the first has exited is ignored after the agreed checkpoint).
    assert rank_exit_codes(result.output) == {0: REQUEUE_EXIT_CODE, 1: REQUEUE_EXIT_CODE}, result.output[-3000:]
    assert result.returncode != 0  # a launcher never reports success for a stopped run


def test_kill_during_save_never_leaves_a_resumable_checkpoint(runs):
    result = runs["outputs"]["kill"]
    assert result.returncode != 0
    assert f"resuming from {runs['out']}/checkpoint-{runs['first_stop']}" in result.output
    # The half-written checkpoint has the trainer state (transformers' own resume would pick it) but
    # lacks rank 1's RNG state and the completion marker.
    assert "trainer_state.json" in runs["half_written_files"]
    assert "rng_state_1.pth" not in runs["half_written_files"]
    assert "checkpoint_complete.json" not in runs["half_written_files"]
    # The survivor did not wait for a timeout: the dead peer's closed socket failed its collective.
    assert result.gone_at[0] - result.gone_at[1] < 30, result.output[-3000:]


def test_next_run_sets_the_half_written_checkpoint_aside_and_resumes_from_the_previous_one(runs):
    output = runs["outputs"]["sigusr1"].output
    assert f"moved checkpoint-{runs['killed_save']} into {runs['out']}/set-aside-" in output
    assert f"resuming from {runs['out']}/checkpoint-{runs['first_stop']}" in output
    assert (next(runs["out"].glob("set-aside-*")) / f"checkpoint-{runs['killed_save']}" / "trainer_state.json").is_file()


def test_sigusr1_to_the_launcher_reaches_every_rank(runs):
    result = runs["outputs"]["sigusr1"]
    assert "rank 0 got SIGUSR1" in result.output and "rank 1 got SIGUSR1" in result.output
    assert runs["killed_save"] <= runs["second_stop"] < STEPS


def test_resumed_run_reproduces_the_uninterrupted_losses(runs):
    reference = read_summary(runs["root"] / "reference")["losses"]
    final = read_summary(runs["out"])
    assert final["resumed_from"] == f"{runs['out']}/checkpoint-{runs['second_stop']}"
    # Every step: those before the last resume from the checkpoint's log, the rest from this launch
    assert list(final["losses"]) == [str(step) for step in range(1, STEPS + 1)]
    for step, loss in final["losses"].items():
        assert loss == pytest.approx(reference[step], abs=1e-4), step


def test_rotation_keeps_the_newest_complete_checkpoints(runs):
    kept = sorted(p.name for p in runs["out"].glob("checkpoint-*"))
    assert kept == newest_two_checkpoints(runs["second_stop"])
    assert all(complete(runs["out"] / name) for name in kept)


def test_data_report_reaches_mlflow(runs):
    db = sqlite3.connect(runs["store"])
    params = dict(db.execute("select key, value from params"))
    report = json.loads((runs["root"] / "reference" / "data_report.json").read_text())
    assert params["data.rows"] == str(report["rows"]) == "300"
    assert params["data.kept"] == "300"


def test_hf_token_from_env_or_file_never_leaks(runs):
    texts = [runs["reference"].stdout, runs["reference"].stderr, runs["final"].stdout, runs["final"].stderr,
             *(result.output for result in runs["outputs"].values())]
    leaks = [index for index, text in enumerate(texts) if ENV_TOKEN in text or FILE_TOKEN in text]
    for path in [runs["store"], *runs["root"].rglob("*")]:
        if path.is_file() and path.name != "hf_token":
            data = path.read_bytes()
            if ENV_TOKEN.encode() in data or FILE_TOKEN.encode() in data:
                leaks.append(str(path))
    assert leaks == []


FAKE_SRUN = """#!/usr/bin/env bash
echo "srun $1 $2" >> "$FAKE_LOG"
[[ -n ${FAKE_SRUN_FINISHES:-} ]] && exit 0
sleep 30 &
trap 'echo "ranks got USR1" >> "$FAKE_LOG"; kill $!; exit 1' USR1
wait $!
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
[[ $1 == show ]] && { echo node-a; exit 0; }
echo "scontrol $*" >> "$FAKE_LOG"
"""


@pytest.mark.parametrize("finishes_first", [False, True])
def test_slurm_script_forwards_usr1_to_the_ranks_and_requeues(tmp_path, finishes_first):
    """scripts/slurm_multinode.sbatch with stand-in srun/scontrol: USR1 reaches srun, then the job requeues."""
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    log = tmp_path / "log"
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "FAKE_LOG": str(log), "SLURM_JOB_ID": "123",
           "SLURM_JOB_NODELIST": "node-a", **({"FAKE_SRUN_FINISHES": "1"} if finishes_first else {})}
    job = subprocess.Popen(["bash", "scripts/slurm_multinode.sbatch"], cwd=REPO_ROOT, env=env)
    deadline = time.monotonic() + 20
    while not (log.is_file() and "srun" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not finishes_first:
        job.send_signal(signal.SIGUSR1)
    assert job.wait(timeout=20) == 0
    lines = log.read_text().splitlines()
    assert lines[0] == "srun --ntasks-per-node=1 --kill-on-bad-exit=1"
    if finishes_first:
        assert lines[1:] == []
    else:
        assert lines[1:] == ["ranks got USR1", "scontrol requeue 123"]
