"""The console a run shows: one compact line per log, train.log as the console's last frames, `make help`."""

from __future__ import annotations

import gc
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT, run_command
from sft_recipes.errors import RecipeError, forget_refusal_hooks, on_refusal, one_line_refusals
from sft_recipes.reporting.console import _Tee, _TrainLog, step_line


def test_a_training_log_is_one_line_with_what_a_user_watches():
    logs = {"loss": 1.23456, "grad_norm": 0.8412, "learning_rate": 2e-05, "peak_memory_gib": 61.25,
            "tokens_per_second_per_device": 1853.6, "mfu": 0.4123, "packing_efficiency": 0.9912, "entropy": 6.2,
            "num_tokens": 665.0, "epoch": 0.0588}
    assert step_line(logs, 20, 60, last_eval=(10, 1.30104), eta_seconds=250.4) == (
        "step 20/60 | loss 1.2346 | eval loss 1.3010 (step 10) | lr 2.00e-05 | grad norm 0.841 | "
        "1,854 tokens/s/device | MFU 41.2% | packing 99.1% | peak 61.25 GiB | ETA 0:04:10")
    assert step_line({"loss": 6.2}, 1, 4) == "step 1/4 | loss 6.2000"
    assert step_line({"eval_loss": 5.87, "eval_tokens": 644, "eval_runtime": 0.05}, 2, 4) == "step 2/4 | eval loss 5.8700"
    assert step_line({"train_runtime": 3.9, "train_loss": 5.887, "epoch": 0.2}, 4, 4) == (
        "step 4/4 | trained in 0:00:04 | mean loss 5.8870")
    # with include_num_input_tokens_seen (our default) transformers adds speed metrics to every step's log
    assert step_line({"loss": 6.2, "num_input_tokens_seen": 1536, "train_runtime": 1.2,
                      "train_tokens_per_second": 1280.0}, 1, 4) == "step 1/4 | loss 6.2000"


def test_the_log_keeps_each_line_and_a_progress_bar_as_its_last_frame():
    console, log = io.StringIO(), io.StringIO()
    tee = _Tee(console, log)
    tee.write("  0%|    | 0/4\r 50%|##  | 2/4")
    tee.write("\r          \rstep 2/4 | loss 5.9737\n 50%|##  | 2/4\r100%|####| 4/4\n")
    tee.write("[train] 4 steps")
    assert console.getvalue().endswith("100%|####| 4/4\n[train] 4 steps")  # the console sees everything
    assert log.getvalue() == "step 2/4 | loss 5.9737\n100%|####| 4/4\n"  # unfinished line: not yet
    tee.write(" in 4.6s\n")
    assert log.getvalue().endswith("100%|####| 4/4\n[train] 4 steps in 4.6s\n")


def test_make_help_lists_every_target():
    makefile = (REPO_ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):(?!=)", makefile, re.M))
    result = run_command(["make", "-s", "help"])
    assert result.returncode == 0, result.stderr
    listed = set(re.findall(r"^make ([a-z][\w-]*)", result.stdout, re.M))
    assert targets >= {"demo", "test", "show", "chat", "help"} and listed == targets, (targets - listed, listed - targets)


def test_the_log_is_held_until_the_run_trains_or_refuses(tmp_path):
    path = tmp_path / "out" / "train.log"
    finished = _TrainLog(path, rank=0)
    finished.write("checkpoint-4 has already trained 4 step(s)\n")
    assert not path.exists()  # a finished run's re-run writes nothing
    refusing = _TrainLog(path, rank=0)
    refusing.write("a line\nerror: bad\n")
    refusing.refused("error: bad")
    _TrainLog(path, rank=1).refused("error: bad")
    assert path.read_text() == "a line\nerror: bad\n[rank 1] error: bad\n"
    training = _TrainLog(path, rank=0)
    training.write("step 1/4 | loss 6.2000\n")
    training.keep()
    training.write("step 2/4 | loss 5.9000\n")
    training.flush()
    assert path.read_text().endswith("[rank 1] error: bad\nstep 1/4 | loss 6.2000\nstep 2/4 | loss 5.9000\n")


def test_a_train_log_on_a_full_disk_leaves_the_refusal_on_the_console_and_exit_2(monkeypatch):
    """The disk fills during a save: the refusal printed through the tee must not die appending to train.log
    (/dev/full: every write that reaches it raises OSError 28, as a full disk does)."""
    unraisable = []  # a buffered file that cannot flush prints `Exception ignored in ...` when collected
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    log = _TrainLog(Path("/dev/full"), rank=0)
    log.write("step 1/6 | loss 6.2000\n")
    log.keep()  # the held lines cannot be written: the log is given up, the run goes on
    console = io.StringIO()
    monkeypatch.setattr(sys, "stderr", _Tee(console, log))
    on_refusal(log.refused)

    def save():
        print("step 6/6 | loss 5.1000", file=sys.stderr)
        raise RecipeError("The disk filled while saving checkpoint-6: ... Free space there and resume.")

    try:
        assert one_line_refusals(save) == 2
    finally:
        forget_refusal_hooks()
    assert console.getvalue() == ("step 6/6 | loss 5.1000\nerror: The disk filled while saving checkpoint-6: ... "
                                  "Free space there and resume.\n")
    monkeypatch.setattr(sys, "stderr", console)
    del log
    gc.collect()
    assert unraisable == []


@pytest.mark.slow  # two fresh interpreters import torch and torchao: ~10 s on 2 cores
def test_two_library_warnings_nobody_can_act_on_are_dropped_from_every_process():
    # torchao (the test requirements; a user's FP8 venv) logs, in every process that imports it: each CUDA extension
    # that cannot load on a CPU torch, and torch's deprecation of its register_constant() calls on Enum classes.
    bare = subprocess.run([sys.executable, "-c", "import torchao"], capture_output=True, text=True, check=True)
    assert "Failed to load" in bare.stderr and "is an Enum subclass" in bare.stderr  # what the filters are for
    quiet = subprocess.run([sys.executable, "-c", "import sft_recipes, torchao"], capture_output=True, text=True,
                           check=True)  # every entry point imports the package first (preflight, chat, show...)
    assert quiet.stderr == ""
