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


def test_a_resumed_run_keeps_the_losses_logged_before_its_checkpoint():
    # The Trainer loads the checkpoint's trainer state (its log_history) before on_train_begin.
    callback = RunSummaryCallback()
    state = TrainerState(max_steps=6, global_step=4, log_history=[
        {"step": 2, "loss": 3.0, "learning_rate": 1e-3}, {"step": 2, "eval_loss": 3.5},
        {"step": 4, "loss": 2.0, "learning_rate": 1e-3}])
    callback.on_train_begin(SimpleNamespace(world_size=1, report_to=[]), state, TrainerControl())
    for state.global_step, loss in ((5, 1.5), (6, 1.25)):
        step(callback, state)
        callback.on_log(SimpleNamespace(), state, TrainerControl(), logs={"loss": loss})
    report = callback.finish(1.0, "out", None, "out/checkpoint-4", "NO over 1 process(es) on cpu")
    assert report["losses"] == {"2": 3.0, "4": 2.0, "5": 1.5, "6": 1.25}
    assert report["eval_losses"] == {"2": 3.5} and report["final_loss"] == 1.25
    assert (report["steps"], report["steps_this_run"]) == (6, 2)
