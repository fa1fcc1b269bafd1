"""What a run reports about itself: per-step losses and timing, `run_summary.json` and its closing line."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from sft_recipes.reporting.data_wait import per_step_text
from sft_recipes.reporting.export_check import ExportCheck


class RunSummaryCallback(TrainerCallback):
    """Collect per-step losses and timing on rank 0 for run_summary.json and the closing line."""

    def __init__(self, tracking_uri: str | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> None:
        self.tracking_uri = tracking_uri  # MLflow's, when the run reports there
        self.overrides = overrides or {}  # Recipe.overrides: the keys each source (parameters, command line) set
        self.losses: dict[int, float] = {}
        self.grad_norms: dict[int, float] = {}  # the norm clipped against: over the whole mesh
        self.first_step: int | None = None
        self.last_step = 0
        self._step_started = 0.0
        self.step_seconds: list[float] = []
        self.mlflow_run_id: str | None = None
        self.last_metrics: dict[str, float] = {}  # the newest throughput/packing figures logged
        self.world_size = 1
        self.world_size_at_checkpoint: int | None = None  # set before training when resuming
        self.eval_losses: dict[int, float] = {}
        self.tokens_seen: int | None = None  # input tokens of every step so far (the Trainer's count, resumes included)
        self.max_steps: int | None = None  # the steps the Trainer planned (max_steps, or the passes' count)
        self.packed_passes: dict[str, Any] | None = None  # packed data counted before training: steps per pass, passes
        self.data_ended: str | None = None  # a stream read once that ended before max_steps: the line that said so

    def on_train_begin(self, args, state, control, **kwargs):
        self.world_size = args.world_size
        self.max_steps = state.max_steps
        # A resumed run starts from the checkpoint's trainer state, whose log_history holds the steps before the
        # resume: the summary keeps them, so its losses cover the whole training and not only this launch.
        for entry in state.log_history:
            self.on_log(args, state, control, logs=entry, step=entry.get("step"))
        if state.is_world_process_zero and "mlflow" in (args.report_to or []):
            import mlflow  # MLflowCallback, earlier in the callback list, has started the run

            run = mlflow.active_run()
            self.mlflow_run_id = run.info.run_id if run else None
            if run:  # tags, not params: a retry logging into the same run (MLFLOW_RUN_ID) may change them
                mlflow.set_tags({"world_size": self.world_size,
                                 "world_size_at_checkpoint": str(self.world_size_at_checkpoint),
                                 **{f"overrides.{source}": json.dumps(values, default=str)[:5000]
                                    for source, values in self.overrides.items()}})

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_seconds.append(time.perf_counter() - self._step_started)
        if self.first_step is None:
            self.first_step = state.global_step
        self.last_step = state.global_step
        self.tokens_seen = state.num_input_tokens_seen or None
        if state.global_step >= state.max_steps:  # the final step's loss is always logged, whatever logging_steps
            control.should_log = True
        return control

    def on_log(self, args, state, control, logs=None, step: int | None = None, **kwargs):
        step = state.global_step if step is None else step  # `step`: an entry of the checkpoint's log_history
        if logs and "loss" in logs:
            self.losses[step] = float(logs["loss"])
        if logs and "grad_norm" in logs:
            self.grad_norms[step] = float(logs["grad_norm"])
        if logs and "eval_loss" in logs:
            self.eval_losses[step] = float(logs["eval_loss"])
        for key in ("packing_efficiency", "tokens_per_second_per_device", "mfu", "peak_memory_gib"):
            if logs and key in logs:
                self.last_metrics[key] = float(logs[key])

    def finish(self, train_seconds: float, output_dir: Path, export_check: ExportCheck, resumed_from: str | None,
               distributed: str, data_wait_seconds: float = 0.0) -> dict[str, Any]:
        """`data_wait_seconds`: rank 0's time fetching micro-batches (`data_wait.DataWaitMixin`), outside the steps."""
        steps_run = len(self.step_seconds)
        return {
            "distributed": distributed,
            "steps": self.last_step,
            "steps_this_run": steps_run,
            "max_steps": self.max_steps,
            "packed_passes": self.packed_passes,
            "data_ended_before_max_steps": self.data_ended,
            "resumed_from": resumed_from,
            "world_size": self.world_size,
            "world_size_at_checkpoint": self.world_size_at_checkpoint,  # null: fresh, or an older marker
            "train_seconds": round(train_seconds, 3),
            "seconds_per_step": round(sum(self.step_seconds) / steps_run, 4) if steps_run else None,
            "seconds_waiting_for_data_per_step": round(data_wait_seconds / steps_run, 4) if steps_run else None,
            "tokens_seen": self.tokens_seen,
            "final_loss": self.losses[max(self.losses)] if self.losses else None,
            "losses": {str(step): loss for step, loss in sorted(self.losses.items())},
            "grad_norms": {str(step): norm for step, norm in sorted(self.grad_norms.items())},
            "eval_loss": self.eval_losses[max(self.eval_losses)] if self.eval_losses else None,
            "eval_losses": {str(step): loss for step, loss in sorted(self.eval_losses.items())},
            "packing_efficiency": self.last_metrics.get("packing_efficiency"),
            "tokens_per_second_per_device": self.last_metrics.get("tokens_per_second_per_device"),
            "mfu": self.last_metrics.get("mfu"),
            "peak_memory_gib": self.last_metrics.get("peak_memory_gib"),
            "checkpoint": str(output_dir),
            "export_max_logit_diff": export_check.max_logit_diff,
            "export_check_left_out": export_check.detail,  # a mixture of experts' router near ties
            "mlflow_tracking_uri": self.tracking_uri,
            "mlflow_run_id": self.mlflow_run_id,
            "overrides": self.overrides,
        }

    @staticmethod
    def closing_line(report: dict[str, Any]) -> str:
        loss = f"{report['final_loss']:.4f}" if report["final_loss"] is not None else "n/a"
        per_step = per_step_text(report["seconds_per_step"], report.get("seconds_waiting_for_data_per_step"))
        speed = report["tokens_per_second_per_device"]
        throughput = f", {speed:,.0f} tokens/s/device" if speed else ""
        mfu = f", MFU {report['mfu']:.1%}" if report["mfu"] else ""
        then, now = report["world_size_at_checkpoint"], report["world_size"]
        moved = f", resumed on {now} process(es) from {then}" if then not in (None, now) else ""
        eval_loss = f", eval loss={report['eval_loss']:.4f}" if report.get("eval_loss") is not None else ""
        ended = (f" of max_steps {report['max_steps']} (the packed stream ended)"
                 if report.get("data_ended_before_max_steps") else "")
        last, this_run = report["steps"], report["steps_this_run"]
        # The time and speed are this run's: a resumed run says which steps it trained
        trained = f"{last} step{'s' if last != 1 else ''}" if not this_run or this_run == last else (
            f"{this_run} step{'s' if this_run != 1 else ''} ({last - this_run + 1}-{last}, resumed at step "
            f"{last - this_run})")
        return (
            f"[train] {trained}{ended} in {report['train_seconds']:.1f}s ({per_step}{throughput}{mfu}), "
            f"final loss={loss}{eval_loss}{moved} | checkpoint: {report['checkpoint']}"
        )
