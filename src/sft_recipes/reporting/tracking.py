"""MLflow out of the box: a local store by default, managed-platform variables honoured, no secrets.

transformers' MLflowCallback does the logging (rank 0 only) and reads MLFLOW_TRACKING_URI,
MLFLOW_EXPERIMENT_NAME and MLFLOW_RUN_ID; we only give them defaults and add the recipe's own keys.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from sft_recipes.data.report import DataReport, MixtureReport

DEFAULT_STORE = "mlruns.db"
SECRET_ENV_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "DATABRICKS_TOKEN", "MLFLOW_TRACKING_TOKEN")


def mlflow_enabled(training_args) -> bool:
    return "mlflow" in (training_args.report_to or [])


def configure_mlflow(training_args, experiment_name: str | None) -> str | None:
    """Set default tracking URI / experiment in the environment; return the URI in use."""
    if not mlflow_enabled(training_args):
        return None
    # The skinny client reads a local sqlite store (with sqlalchemy + alembic); the plain file
    # store is deprecated and refused unless MLFLOW_ALLOW_FILE_STORE is set.
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{Path(DEFAULT_STORE).resolve()}")
    if experiment_name:
        os.environ.setdefault("MLFLOW_EXPERIMENT_NAME", experiment_name)
    return os.environ["MLFLOW_TRACKING_URI"]


def redact(values: dict[str, Any]) -> dict[str, Any]:
    """Replace any value that contains a secret from the environment."""
    secrets = [os.environ[name] for name in SECRET_ENV_VARS if os.environ.get(name)]
    return {k: "<redacted>" if any(s in str(v) for s in secrets) else v for k, v in values.items()}


class RecipeParamsCallback(TrainerCallback):
    """Log the recipe's own keys (data/model/export settings) next to the TrainingArguments."""

    def __init__(self, recipe_values: dict[str, Any]):
        self.params = redact({f"recipe.{k}": str(v)[:250] for k, v in recipe_values.items()})

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and mlflow_enabled(args):
            import mlflow

            if mlflow.active_run() is not None:
                mlflow.log_params(self.params)


class DataReportCallback(TrainerCallback):
    """Write the report to output_dir/data_report.json; log its counts to MLflow as `data.*` params.

    Rows read while training (a packed stream's readers, a stream read unpacked) are counted as they
    are read: at the end the report is printed again and the file written again with those counts.
    """

    def __init__(self, report: DataReport | MixtureReport, counted_while_training: bool = False) -> None:
        self.report = report
        self.counted_while_training = counted_while_training  # a packed stream's drops: written again at the end

    def _write(self, args) -> dict:
        summary = self.report.as_dict()
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        Path(args.output_dir, "data_report.json").write_text(json.dumps(summary, indent=2, default=str))
        return summary

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.counted_while_training:
            print(f"[data] read while training:\n{self.report.format()}", flush=True)
            self._write(args)

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self._write(args)
        if not mlflow_enabled(args):
            return
        import mlflow

        if mlflow.active_run() is not None:
            mlflow.log_params(self.report.mlflow_params())
