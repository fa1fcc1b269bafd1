"""The run summary always holds the final step's loss, whatever `logging_steps` says."""

from __future__ import annotations

from types import SimpleNamespace

from transformers import TrainerControl, TrainerState

from sft_recipes.reporting.summary import RunSummaryCallback


def step(callback: RunSummaryCallback, state: TrainerState) -> TrainerControl:
    control = TrainerControl()
    callback.on_step_begin(SimpleNamespace(), state, control)
    return callback.on_step_end(SimpleNamespace(), state, control)


def test_the_last_step_is_logged_even_between_logging_steps():
    callback, state = RunSummaryCallback(), TrainerState(max_steps=3)
    decisions = []
    for state.global_step in (1, 2, 3):
        decisions.append(step(callback, state).should_log)
    assert decisions == [False, False, True]
    callback.on_log(SimpleNamespace(), state, TrainerControl(), logs={"loss": 2.5})
    report = callback.finish(1.0, "out", None, None, "NO over 1 process(es) on cpu")
    assert report["final_loss"] == 2.5 and report["losses"] == {"3": 2.5} and report["steps"] == 3
    assert RunSummaryCallback.closing_line(report).endswith("final loss=2.5000 | checkpoint: out")
