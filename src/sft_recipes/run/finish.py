"""The end of a run: export (consolidated checkpoint or adapter), the reload check, samples, the summary,
benchmark scores of the export and the base (run/scoring.py), the model card, MLflow artifacts and the
optional Hub push (not for a regressed export). A regression, an export that could not be scored, or a push the Hub
failed refuses the run on every rank (run/outcome.py), the export kept."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sft_recipes.architectures.sequence_parallel import sequence_parallel_suspended
from sft_recipes.errors import RecipeError
from sft_recipes.export import copy_processor_files, export_run
from sft_recipes.reporting.data_wait import data_wait_warning
from sft_recipes.reporting.export_check import ExportCheck
from sft_recipes.reporting.load_export import load_export
from sft_recipes.reporting.run_end import report_run_end
from sft_recipes.reporting.samples import prompt_style, random_stand_in, sample_settings, write_samples
from sft_recipes.run.outcome import publish_outcome, rank_0_may_refuse_at_the_end, wait_for_outcome
from sft_recipes.run.scoring import score_run, wants_benchmarks
from sft_recipes.run.setup import Run
from sft_recipes.run.training import Training


@dataclass(frozen=True)
class RunResult:
    """What a finished run hands back, on every rank (what `sft_recipes.train()` returns)."""

    output_dir: str  # the export: a consolidated checkpoint, or the adapter
    losses: dict[int, float]  # training loss per logged optimizer step (the mean over ranks: the same on each)
    eval_loss: float | None  # of the final weights, when the recipe has eval data
    export_check: ExportCheck  # passed (with the max logit difference) or skipped; a failed check raised
    mlflow_run_id: str | None  # the run rank 0 logged into (None on other ranks, and without MLflow)
    summary: dict[str, Any] | None  # run_summary.json, on rank 0 only

    @property
    def final_loss(self) -> float | None:
        return self.losses[max(self.losses)] if self.losses else None


def earlier_result(run: Run) -> RunResult:
    """A run already at max_steps (`run.finished`, nothing trained now): the result its run_summary.json holds."""
    output_dir = Path(run.recipe.training.output_dir)
    try:
        report = json.loads((output_dir / "run_summary.json").read_text())
    except (OSError, ValueError):
        raise RecipeError(f"{run.finished} -- and {output_dir} holds no readable run_summary.json (the earlier run "
                          "stopped before its export): pass overwrite_output_dir=True to train again.") from None
    losses = {int(step): loss for step, loss in report["losses"].items()}
    return RunResult(output_dir=report["checkpoint"], losses=losses, eval_loss=report.get("eval_loss"),
                     export_check=ExportCheck.from_summary(report),
                     mlflow_run_id=report.get("mlflow_run_id") if run.is_main else None,
                     summary=report if run.is_main else None)


def finish(run: Run, training: Training) -> RunResult:
    """Export and check the result (collective), then on rank 0 write samples.md (from the model the check
    reloaded), run_summary.json, the card, log them to MLflow, push when asked, and print the closing line."""
    recipe, trainer = run.recipe, training.trainer
    output_dir = recipe.training.output_dir

    def samples_after(reloaded) -> None:
        write_samples(output_dir, training.sample_prompts, reloaded, trainer.processing_class,
                      **sample_settings(recipe), stand_in_note=random_stand_in(recipe.model.model_name_or_path))

    with sequence_parallel_suspended():  # the reload check runs its probe whole on every rank
        output_dir, export_check = export_run(trainer, recipe.model, output_dir, load_base=run.source.load_model,
                                              on_reloaded=samples_after if training.sample_prompts else None)
    summary = training.summary
    result = RunResult(output_dir=str(output_dir), losses=dict(sorted(summary.losses.items())),
                       eval_loss=summary.eval_losses[max(summary.eval_losses)] if summary.eval_losses else None,
                       export_check=export_check, mlflow_run_id=summary.mlflow_run_id,
                       summary=None)
    rank_0_decides = rank_0_may_refuse_at_the_end(recipe.training, run.hub_push)
    if not run.is_main:
        if rank_0_decides and (refusal := wait_for_outcome()):
            raise RecipeError(refusal)  # rank 0 prints it; every rank exits 2
        return result
    # a VLM's image processor: the export loads as it came in
    copy_processor_files(run.source.processor_files(), output_dir)
    report = summary.finish(training.seconds, output_dir, export_check, training.resumed_from, training.layout,
                            trainer.data_wait_seconds)
    # How to prompt the export as it was trained, and whether it is a random stand-in (scripts/show_run.py reads both)
    report.update(prompt_style=prompt_style(recipe.data), stand_in_note=random_stand_in(recipe.model.model_name_or_path))
    Path(output_dir, "run_summary.json").write_text(json.dumps(report, indent=2))
    if training.sample_prompts and export_check.status == "skipped":  # no export check, so no reloaded model to reuse
        samples_after(load_export(output_dir)[0])
    benchmarks = None
    if wants_benchmarks(recipe.training):  # the export and its summary are on disk whatever scoring does
        benchmarks = score_run(run, output_dir)
        report["benchmarks"] = benchmarks.as_summary()
        Path(output_dir, "run_summary.json").write_text(json.dumps(report, indent=2))
    refusal = benchmarks.refusal if benchmarks is not None else None
    push = None if refusal else run.hub_push  # a regressed or unscored export is never pushed
    push_refusal = report_run_end(recipe, trainer.state, run.source.path, output_dir, result.export_check,
                                  summary.mlflow_run_id, push, benchmarks=benchmarks)  # the card whatever the gate said
    refusal = refusal or push_refusal
    waiting = data_wait_warning(report["seconds_per_step"], report["seconds_waiting_for_data_per_step"],
                                recipe.training.dataloader_num_workers)
    if waiting:
        print(waiting, flush=True)
    if benchmarks is not None:  # base against tuned, as `make show` says it (the card has the table)
        from sft_recipes.scores.compare import comparison_lines

        for line in comparison_lines(report["benchmarks"]["tasks"]) or [f"scoring failed: {benchmarks.error}"]:
            print(f"[benchmarks] {line}", flush=True)
    print(summary.closing_line(report), flush=True)
    if rank_0_decides:
        publish_outcome(refusal)
    if refusal:
        raise RecipeError(refusal)
    return dataclasses.replace(result, summary=report)
