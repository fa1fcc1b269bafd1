"""Files of a run logged to its MLflow run as artifacts (rank 0 only; tracking set up in reporting/tracking.py).

transformers' MLflowCallback ends the run at train end, before the export, the samples and the
card exist; so files are logged by run id through `MlflowClient`, which needs no active run.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from sft_recipes.reporting.tracking import mlflow_enabled

# What the end of a run logs from output_dir when present (plan.json: a dry run's --plan-json saved there).
RUN_ARTIFACTS = ("training_curves.png", "samples.md", "README.md", "data_report.json", "run_summary.json",
                 "plan.json", "benchmark_scores.png")


def active_mlflow_run_id(training_args) -> str | None:
    if not mlflow_enabled(training_args):
        return None
    import mlflow

    run = mlflow.active_run()
    return run.info.run_id if run else None


def log_run_artifacts(run_id: str, paths: Iterable[str | Path]) -> list[Path]:
    """Log each existing file in `paths` to MLflow run `run_id`; return the files logged."""
    from mlflow import MlflowClient

    client = MlflowClient()
    logged = []
    for path in map(Path, paths):
        if path.is_file():
            client.log_artifact(run_id, str(path))
            logged.append(path)
    return logged


def log_output_dir_artifacts(run_id: str | None, output_dir: str | Path) -> list[Path]:
    """The end-of-run files (RUN_ARTIFACTS) found in `output_dir`, logged to `run_id`; nothing without a run."""
    if not run_id:
        return []
    return log_run_artifacts(run_id, [Path(output_dir) / name for name in RUN_ARTIFACTS])
