"""The run summary always holds the final step's loss, whatever `logging_steps` says."""

from __future__ import annotations

import time
from types import SimpleNamespace

from transformers import TrainerControl, TrainerState

from sft_recipes.reporting.export_check import ExportCheck
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
    report = callback.finish(1.0, "out", ExportCheck("skipped"), None, "NO over 1 process(es) on cpu")
    assert report["final_loss"] == 2.5 and report["losses"] == {"3": 2.5} and report["steps"] == 3
    assert RunSummaryCallback.closing_line(report).startswith("[train] 3 steps in 1.0s (")
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
    report = callback.finish(1.0, "out", ExportCheck("skipped"), "out/checkpoint-4", "NO over 1 process(es) on cpu")
    assert report["losses"] == {"2": 3.0, "4": 2.0, "5": 1.5, "6": 1.25}
    assert report["eval_losses"] == {"2": 3.5} and report["final_loss"] == 1.25
    assert (report["steps"], report["steps_this_run"]) == (6, 2)
    # The time is this run's two steps, and the line says so (it said "[train] 6 steps in 1.0s")
    assert RunSummaryCallback.closing_line(report).startswith("[train] 2 steps (5-6, resumed at step 4) in 1.0s (")


def test_the_wait_for_data_is_shown_beside_the_steps_and_warned_about_when_it_dominates():
    """8000 x 8000 images: 57 s a step, of which the step itself took 1.01 s (the fetch comes before it)."""
    from sft_recipes.reporting.data_wait import DataWaitMixin, data_wait_warning, per_step_text

    class Fetching:
        def get_batch_samples(self, epoch_iterator, num_batches, device):
            return [next(epoch_iterator) for _ in range(num_batches)], None

    class Timed(DataWaitMixin, Fetching):
        pass

    def slow_rows():
        while True:
            time.sleep(0.05)
            yield {"input_ids": [1]}

    trainer, rows = Timed(), slow_rows()
    for _ in range(2):
        assert trainer.get_batch_samples(rows, 2, "cpu")[0] == [{"input_ids": [1]}] * 2
    assert 0.2 <= trainer.data_wait_seconds < 1.0  # 4 rows of 0.05 s

    callback, state = RunSummaryCallback(), TrainerState(max_steps=2)
    for state.global_step in (1, 2):
        step(callback, state)
    callback.step_seconds = [1.01, 1.01]
    report = callback.finish(116.0, "out", ExportCheck("skipped"), None, "FSDP2 over 2 process(es) on cpu",
                             data_wait_seconds=112.0)
    assert report["seconds_waiting_for_data_per_step"] == 56.0
    assert RunSummaryCallback.closing_line(report).startswith(
        "[train] 2 steps in 116.0s (1.01s/step + 56.00s/step waiting for data), ")
    assert data_wait_warning(report["seconds_per_step"], report["seconds_waiting_for_data_per_step"], 0) == (
        "[train] waiting for data took 98% of each step (56.00s waiting, 1.01s computing): raise "
        "dataloader_num_workers (now 0) or make rows cheaper to read (smaller images, shorter rows, data on a local disk)")
    quick = callback.finish(2.1, "out", ExportCheck("skipped"), None, "", data_wait_seconds=0.08)  # 0.04 s a step: not worth a word
    assert "waiting" not in RunSummaryCallback.closing_line(quick)
    assert data_wait_warning(quick["seconds_per_step"], quick["seconds_waiting_for_data_per_step"], 0) is None
    assert per_step_text(0.02, 0.004) == "0.02s/step"  # a fifth of the step, but it would print as 0.00s
    assert per_step_text(0.02, 0.005) == "0.02s/step + 0.01s/step waiting for data"


def test_the_export_check_and_what_it_left_out_are_in_the_summary_and_read_back():
    left_out = "2 of 64 probe positions left out: a near tie in a router sent them to other experts in the reload"
    report = RunSummaryCallback().finish(1.0, "out", ExportCheck("passed", 0.0044, left_out), None, "")
    assert (report["export_max_logit_diff"], report["export_check_left_out"]) == (0.0044, left_out)
    assert ExportCheck.from_summary(report) == ExportCheck("passed", 0.0044, left_out)
    skipped = RunSummaryCallback().finish(1.0, "out", ExportCheck("skipped"), None, "")
    assert (skipped["export_max_logit_diff"], skipped["export_check_left_out"]) == (None, "")
    assert ExportCheck.from_summary(skipped) == ExportCheck("skipped")
