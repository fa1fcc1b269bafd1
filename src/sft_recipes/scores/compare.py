"""Base against tuned, task by task: the change, the gate, the tables (console, card) and the picture."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sft_recipes.scores.harness import TaskScore

SCORES_PICTURE = "benchmark_scores.png"


@dataclass(frozen=True)
class Comparison:
    """One task's score for both models under the same settings; `max_regression` is the gate's allowance."""

    task: str
    metric: str
    base: float
    tuned: float
    base_stderr: float | None
    tuned_stderr: float | None
    samples: int
    max_regression: float | None

    @property
    def change(self) -> float:
        return self.tuned - self.base

    @property
    def regressed(self) -> bool:
        return self.max_regression is not None and self.change < -self.max_regression

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "change": self.change, "regressed": self.regressed}


def compare(base: dict[str, TaskScore], tuned: dict[str, TaskScore], max_regression) -> list[Comparison]:
    from sft_recipes.scores.tasks import max_regression_for

    return [Comparison(name, score.metric, base[name].value, score.value, base[name].stderr, score.stderr,
                       score.samples, max_regression_for(max_regression, name)) for name, score in tuned.items()]


def regression_refusal(rows: list[Comparison], output_dir: str | Path) -> str | None:
    """The gate's one line when a task regressed beyond its allowance (None: every task passed)."""
    failed = [row for row in rows if row.regressed]
    if not failed:
        return None
    what = "; ".join(_regression(row) for row in failed)
    return (f"the fine-tuned model regressed: {what}. The export stays in {output_dir}, marked regressed in its "
            "README.md and run_summary.json, and was not pushed: change the data or the training, or raise "
            "eval_max_regression if the drop is acceptable")


def _regression(row: Comparison) -> str:
    if row.max_regression >= 0:
        return (f"{row.task} {row.metric} fell from {row.base:.4f} (base) to {row.tuned:.4f} (tuned), a drop of "
                f"{row.base - row.tuned:.4f} where eval_max_regression allows {row.max_regression:.4f}")
    return (f"{row.task} {row.metric} went from {row.base:.4f} (base) to {row.tuned:.4f} (tuned), a change of "
            f"{row.change:+.4f} where eval_max_regression {row.max_regression:.4f} demands a gain of at least "
            f"{-row.max_regression:.4f}")


def _number(value: float | None, spec: str = ".4f") -> str:
    return "n/a" if value is None else format(value, spec)


def _stderr(row: Comparison) -> str:
    return f"±{_number(row.base_stderr)} / ±{_number(row.tuned_stderr)}"


def markdown_table(rows: list[Comparison]) -> str:
    lines = ["| task | metric | base | tuned | change | stderr (base / tuned) | examples | gate |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        gate = "n/a" if row.max_regression is None else ("**regressed**" if row.regressed else "passed")
        lines.append(f"| {row.task} | {row.metric} | {row.base:.4f} | {row.tuned:.4f} | {row.change:+.4f} | "
                     f"{_stderr(row)} | {row.samples} | {gate} |")
    return "\n".join(lines)


def console_table(scores: dict[str, TaskScore]) -> str:
    """One model's scores, as scripts/evaluate.py prints them."""
    width = max([len("task"), *map(len, scores)])
    lines = [f"{'task':<{width}}  {'metric':<28}  {'value':>8}  {'stderr':>8}  examples"]
    for name, score in scores.items():
        lines.append(f"{name:<{width}}  {score.metric:<28}  {score.value:>8.4f}  {_number(score.stderr):>8}  "
                     f"{score.samples}")
    return "\n".join(lines)


def comparison_lines(rows: list[dict[str, Any]]) -> list[str]:
    """A summary's `benchmarks.tasks` rows as console lines (scripts/show_run.py, the run's `[benchmarks]` lines)."""
    return [f"{row['task']} {row['metric']}: base {row['base']:.4f} -> tuned {row['tuned']:.4f} "
            f"({row['change']:+.4f}){' REGRESSED' if row['regressed'] else ''}" for row in rows]


def draw_scores(rows: list[Comparison], path: str | Path) -> Path:
    """`benchmark_scores.png`: base and tuned side by side per task, with lm-eval's stderr as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(max(5, 1.6 * len(rows) + 2), 4))
    positions = range(len(rows))
    for offset, label, values, errors in (
            (-0.2, "base", [r.base for r in rows], [r.base_stderr or 0 for r in rows]),
            (0.2, "tuned", [r.tuned for r in rows], [r.tuned_stderr or 0 for r in rows])):
        bars = axis.bar([p + offset for p in positions], values, width=0.4, yerr=errors, capsize=3, label=label)
        axis.bar_label(bars, labels=[f"{v:.3f}" for v in values], fontsize=8)
    axis.set_xticks(list(positions), [f"{r.task}\n{r.metric}" + ("\nREGRESSED" if r.regressed else "") for r in rows],
                    fontsize=8)
    axis.set_ylabel("score")
    axis.set_title("benchmark scores: base vs tuned (error bars: stderr)")
    axis.legend()
    axis.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def mlflow_metrics(rows: list[Comparison]) -> dict[str, float]:
    """`benchmark/<task>/<metric>_<filter>/{base,tuned,change}` (MLflow keys allow no comma)."""
    metrics = {}
    for row in rows:
        prefix = f"benchmark/{row.task}/{row.metric.replace(',', '_')}"
        metrics.update({f"{prefix}/base": row.base, f"{prefix}/tuned": row.tuned, f"{prefix}/change": row.change})
    return metrics
