"""`training_curves.png`: train (and eval) loss, learning rate and tokens/s per device against the step.

Drawn headless (matplotlib's Agg backend) from the Trainer's `state.log_history`, at every
checkpoint save and at the end of training, on rank 0 only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from sft_recipes.reporting.mlflow_artifacts import active_mlflow_run_id, log_run_artifacts

CURVES_FILE = "training_curves.png"
THROUGHPUT_KEY = "tokens_per_second_per_device"  # logged by sft_recipes.metrics.ThroughputMeter

# (panel title, [(log key, line label)]) -- one panel per quantity, step on every x axis.
PANELS = (
    ("loss", [("loss", "train"), ("eval_loss", "eval")]),
    ("learning rate", [("learning_rate", "learning rate")]),
    ("tokens/s per device", [(THROUGHPUT_KEY, "tokens/s per device")]),
)


def series(log_history: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of every log entry that has `key`, in logged order."""
    points = [(entry["step"], float(entry[key])) for entry in log_history if key in entry and "step" in entry]
    return [step for step, _ in points], [value for _, value in points]


def draw_training_curves(log_history: list[dict[str, Any]]):
    """The figure of the three panels. A quantity never logged leaves its panel empty, saying so."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(len(PANELS), 1, figsize=(8, 9), sharex=True)
    for axis, (title, lines) in zip(axes, PANELS):
        drawn = False
        for key, label in lines:
            steps, values = series(log_history, key)
            if steps:
                axis.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
                drawn = True
        axis.set_title(title)
        axis.grid(alpha=0.3)
        if drawn and len(lines) > 1:
            axis.legend()
        if not drawn:
            axis.text(0.5, 0.5, "not logged", ha="center", va="center", transform=axis.transAxes)
    axes[-1].set_xlabel("step")
    # Steps are whole: with few points (a run resumed near its end) matplotlib would tick 4.8, 5.0, 5.2.
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # one step: one tick
    figure.tight_layout()
    return figure


def write_training_curves(log_history: list[dict[str, Any]], path: str | Path) -> Path:
    """Draw the three panels into `path` (PNG)."""
    import matplotlib.pyplot as plt

    path = Path(path)
    figure = draw_training_curves(log_history)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


class TrainingCurvesCallback(TrainerCallback):
    """Rewrite `output_dir/training_curves.png` at each save and at train end (rank 0), and log it to the active
    MLflow run when there is one."""

    def _draw(self, args, state) -> None:
        if not state.is_world_process_zero:
            return
        path = write_training_curves(state.log_history, Path(args.output_dir) / CURVES_FILE)
        run_id = active_mlflow_run_id(args)
        if run_id:
            log_run_artifacts(run_id, [path])

    def on_save(self, args, state, control, **kwargs):
        self._draw(args, state)

    def on_train_end(self, args, state, control, **kwargs):
        self._draw(args, state)
