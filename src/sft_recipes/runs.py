"""What a run reports about itself: where it resumed from, its losses, and its closing line."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

logger = logging.getLogger(__name__)


def resolve_resume_checkpoint(training_args) -> str | None:
    """`resume_from_checkpoint`: None (fresh), "auto" (newest in output_dir, else fresh) or a path."""
    wanted = training_args.resume_from_checkpoint
    if wanted is None:
        return None
    if wanted == "auto":
        output_dir = Path(training_args.output_dir)
        last = get_last_checkpoint(str(output_dir)) if output_dir.is_dir() else None
        if training_args.process_index == 0:
            logger.info("resume_from_checkpoint=auto: %s", f"resuming from {last}" if last else "no checkpoint, starting fresh")
        return last
    if not Path(wanted).is_dir():
        raise ValueError(
            f"resume_from_checkpoint={wanted!r} is not a checkpoint directory. Use 'auto' to take the newest "
            f"checkpoint in output_dir, or a path like {training_args.output_dir}/checkpoint-100."
        )
    return wanted


class RunSummaryCallback(TrainerCallback):
    """Collect per-step losses and timing on rank 0 for run_summary.json and the closing line."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.first_step: int | None = None
        self.last_step = 0
        self._step_started = 0.0
        self.step_seconds: list[float] = []
        self.mlflow_run_id: str | None = None
        self.packing_efficiency: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and "mlflow" in (args.report_to or []):
            import mlflow  # MLflowCallback, earlier in the callback list, has started the run

            run = mlflow.active_run()
            self.mlflow_run_id = run.info.run_id if run else None

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_seconds.append(time.perf_counter() - self._step_started)
        if self.first_step is None:
            self.first_step = state.global_step
        self.last_step = state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = float(logs["loss"])
        if logs and "packing_efficiency" in logs:
            self.packing_efficiency = float(logs["packing_efficiency"])

    def finish(self, train_seconds: float, output_dir: Path, tracking_uri: str | None, logit_diff: float | None,
               resumed_from: str | None, distributed: str) -> dict[str, Any]:
        steps_run = len(self.step_seconds)
        return {
            "distributed": distributed,
            "steps": self.last_step,
            "steps_this_run": steps_run,
            "resumed_from": resumed_from,
            "train_seconds": round(train_seconds, 3),
            "seconds_per_step": round(sum(self.step_seconds) / steps_run, 4) if steps_run else None,
            "final_loss": self.losses[max(self.losses)] if self.losses else None,
            "losses": {str(step): loss for step, loss in sorted(self.losses.items())},
            "packing_efficiency": self.packing_efficiency,
            "checkpoint": str(output_dir),
            "export_max_logit_diff": logit_diff,
            "mlflow_tracking_uri": tracking_uri,
            "mlflow_run_id": self.mlflow_run_id,
        }

    @staticmethod
    def closing_line(report: dict[str, Any]) -> str:
        loss = f"{report['final_loss']:.4f}" if report["final_loss"] is not None else "n/a"
        per_step = f"{report['seconds_per_step']:.2f}s/step" if report["seconds_per_step"] else "n/a"
        return (
            f"[train] {report['steps']} steps in {report['train_seconds']:.1f}s ({per_step}), final loss={loss} | "
            f"checkpoint: {report['checkpoint']}"
        )
