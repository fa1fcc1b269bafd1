"""`training_curves.png`: train (and eval) loss, learning rate and tokens/s per device against the step.

Drawn headless (matplotlib's Agg backend) from the Trainer's `state.log_history`, at every
checkpoint save, at the end of training and after the final eval, on rank 0 only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from sft_recipes.reporting.mlflow_artifacts import active_mlflow_run_id, log_run_artifacts

CURVES_FILE = "training_curves.png"
THROUGHPUT_KEY = "tokens_per_second_per_device"  # logged by sft_recipes.metrics.ThroughputMeter

# (panel title, [(log key, line label)], height share) -- one panel per quantity, step on every x axis. The
# learning rate gets the least height: its shape (warmup, decay) reads at a glance, and a constant one is a line.
PANELS = (
    ("loss", [("loss", "train"), ("eval_loss", "eval")], 3),
    ("learning rate", [("learning_rate", "learning rate")], 1),
    ("tokens/s per device", [(THROUGHPUT_KEY, "tokens/s per device")], 2),
)
FIGURE_SIZE = (8, 7)  # inches


def series(log_history: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of every log entry that has `key`, in logged order."""
    points = [(entry["step"], float(entry[key])) for entry in log_history if key in entry and "step" in entry]
    return [step for step, _ in points], [value for _, value in points]


def stopped_early(log_history: list[dict[str, Any]], max_steps: int | None) -> int | None:
    """The last step of a run that ended before `max_steps` (data ended, preempted, stopped), else None."""
    steps = [entry["step"] for entry in log_history if "step" in entry]
    return max(steps) if steps and max_steps and max(steps) < max_steps else None


def draw_training_curves(log_history: list[dict[str, Any]], max_steps: int | None = None):
    """The figure of the three panels. A quantity never logged leaves its panel empty, saying so; a constant
    learning rate says its value; a run that ended before `max_steps` shows where, and the steps it did not run."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(len(PANELS), 1, figsize=FIGURE_SIZE, sharex=True,
                                gridspec_kw={"height_ratios": [height for *_, height in PANELS]})
    for axis, (title, lines, _) in zip(axes, PANELS):
        drawn = False
        for key, label in lines:
            steps, values = series(log_history, key)
            if steps:
                axis.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
                drawn = True
                if key == "learning_rate" and len(set(values)) == 1:
                    title = f"learning rate (constant {values[0]:.2e})"
        axis.set_title(title, fontsize=10)
        axis.grid(alpha=0.3)
        if drawn and len(lines) > 1:
            axis.legend()
        if not drawn:
            axis.text(0.5, 0.5, "not logged", ha="center", va="center", transform=axis.transAxes)
    last = stopped_early(log_history, max_steps)
    if last is not None:
        for axis in axes:
            axis.axvline(last, color="tab:red", linestyle="--", linewidth=1)
            axis.set_xlim(right=max_steps)
        figure.suptitle(f"stopped at step {last} of {max_steps}", color="tab:red")
    axes[-1].set_xlabel("step")
    # Steps are whole: with few points (a run resumed near its end) matplotlib would tick 4.8, 5.0, 5.2.
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # one step: one tick
    figure.tight_layout()
    return figure


def write_training_curves(log_history: list[dict[str, Any]], path: str | Path, max_steps: int | None = None) -> Path:
    """Draw the three panels into `path` (PNG)."""
    import matplotlib.pyplot as plt

    path = Path(path)
    figure = draw_training_curves(log_history, max_steps)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


class TrainingCurvesCallback(TrainerCallback):
    """Rewrite `output_dir/training_curves.png` at each save, at train end, and after the final eval of the last
    weights (which runs after train end: `run.training.Training.run`), on rank 0; log it to the active MLflow run
    when there is one."""

    def __init__(self) -> None:
        self.ended = False

    def _draw(self, args, state) -> None:
        if not state.is_world_process_zero:
            return
        path = write_training_curves(state.log_history, Path(args.output_dir) / CURVES_FILE, state.max_steps)
        run_id = active_mlflow_run_id(args)
        if run_id:
            log_run_artifacts(run_id, [path])

    def on_save(self, args, state, control, **kwargs):
        self._draw(args, state)

    def on_train_end(self, args, state, control, **kwargs):
        self.ended = True
        self._draw(args, state)

    def on_evaluate(self, args, state, control, **kwargs):
        if self.ended:  # the final eval point: not in the picture drawn at train end
            self._draw(args, state)
