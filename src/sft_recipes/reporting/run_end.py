"""The reporting half of a run's finish step, on rank 0 after the export and its check.

Order: samples (already written by `write_samples` from the export check's reloaded model), model
card, MLflow artifacts, then the Hub push (refused unless the export check passed; a push the Hub fails is a
refusal that keeps the export: reporting/hub.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from sft_recipes.reporting.card import CardFacts, base_license, data_sources_from, last_logged, write_model_card
from sft_recipes.reporting.export_check import ExportCheck
from sft_recipes.reporting.hub import HubPush, push_or_refusal
from sft_recipes.reporting.mlflow_artifacts import log_output_dir_artifacts
from sft_recipes.reporting.samples import random_stand_in
from sft_recipes.scores.compare import SCORES_PICTURE, draw_scores, mlflow_metrics

logger = logging.getLogger(__name__)


def hardware_of(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type.upper()


def card_facts_for_run(recipe, state, model_path: str | Path, export_check: ExportCheck,
                       data_sources: list[dict] | None = None, benchmarks=None) -> CardFacts:
    """What the card says about this run: `state` is the Trainer's state; `data_sources` the recipe's sources
    (default: its `datasets:` mixture, weighted by fraction, else its one dataset_name/dataset_revision)."""
    data, model, training = recipe.data, recipe.model, recipe.training
    mixture = [{**source, "weight": source.get("fraction")} for source in data.datasets or []]
    sources = data_sources or mixture or [{"name": data.dataset_name, "revision": data.dataset_revision,
                                           "split": data.dataset_train_split}]
    return CardFacts(
        base_model=model.model_name_or_path, base_revision=model.model_revision,
        data_sources=data_sources_from(sources), recipe_values=recipe.values, recipe_path=str(recipe.source),
        export_kind="adapter" if model.use_peft else "full", export_check=export_check,
        hardware=f"{training.world_size} x {hardware_of(training.device)}", world_size=training.world_size,
        steps=state.global_step, tokens_seen=state.num_input_tokens_seen or None,
        final_train_loss=last_logged(state.log_history, "loss"),
        final_eval_loss=last_logged(state.log_history, "eval_loss"),
        license=base_license(model_path), hub_model_id=training.hub_model_id,
        stand_in_note=random_stand_in(model.model_name_or_path),
        benchmarks=benchmarks,
    )


def report_run_end(recipe, state, model_path: str | Path, output_dir: str | Path, export_check: ExportCheck,
                   mlflow_run_id: str | None, hub_push: HubPush | None, data_sources: list[dict] | None = None,
                   benchmarks=None) -> str | None:
    """Rank 0: write the card (and the benchmark picture), log the run's files and benchmark scores to MLflow, push
    when asked. Call after run_summary.json. `benchmarks`: run/scoring.py's Benchmarks, or None. Returns the push's
    refusal (the Hub failed it), None otherwise."""
    if benchmarks is not None and benchmarks.rows:
        draw_scores(benchmarks.rows, Path(output_dir) / SCORES_PICTURE)
    card = write_model_card(card_facts_for_run(recipe, state, model_path, export_check, data_sources, benchmarks),
                            output_dir)
    logger.info("model card: %s", card)
    log_output_dir_artifacts(mlflow_run_id, output_dir)
    if mlflow_run_id and benchmarks is not None and benchmarks.rows:
        from mlflow import MlflowClient

        client = MlflowClient()
        for key, value in mlflow_metrics(benchmarks.rows).items():
            client.log_metric(mlflow_run_id, key, value)
    if hub_push is None:
        return None
    if refusal := push_or_refusal(hub_push, output_dir, export_check):
        return refusal
    logger.info("pushed %s to https://huggingface.co/%s (%s)", output_dir, hub_push.repo_id,
                "private" if hub_push.private else "public")
    return None
