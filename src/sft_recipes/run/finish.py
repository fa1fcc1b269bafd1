"""The end of a run: export (consolidated checkpoint or adapter), the reload check, samples, the summary,
the model card, MLflow artifacts and the optional Hub push."""

from __future__ import annotations

import json
from pathlib import Path

from sft_recipes.architectures.sequence_parallel import sequence_parallel_suspended
from sft_recipes.export import copy_processor_files, export_run
from sft_recipes.reporting.export_check import ExportCheck
from sft_recipes.reporting.load_export import load_export
from sft_recipes.reporting.run_end import report_run_end
from sft_recipes.reporting.samples import sample_settings, write_samples
from sft_recipes.run.setup import Run
from sft_recipes.run.training import Training


def finish(run: Run, training: Training) -> dict | None:
    """Export and check the result (collective), then on rank 0 write samples.md (from the model the check
    reloaded), run_summary.json, the card, log them to MLflow, push when asked, and print the closing line.
    Returns the summary on rank 0."""
    recipe, trainer = run.recipe, training.trainer
    output_dir = recipe.training.output_dir

    def samples_after(reloaded) -> None:
        write_samples(output_dir, training.sample_prompts, reloaded, trainer.processing_class,
                      **sample_settings(recipe))

    with sequence_parallel_suspended():  # the reload check runs its probe whole on every rank
        output_dir, logit_diff = export_run(trainer, recipe.model, output_dir, load_base=run.source.load_model,
                                            on_reloaded=samples_after if training.sample_prompts else None)
    if not run.is_main:
        return None
    copy_processor_files(run.source.path, output_dir)  # a VLM's image processor: the export loads as it came in
    summary = training.summary
    report = summary.finish(training.seconds, output_dir, logit_diff, training.resumed_from, training.layout)
    Path(output_dir, "run_summary.json").write_text(json.dumps(report, indent=2))
    if training.sample_prompts and logit_diff is None:  # no export check, so no reloaded model to reuse
        samples_after(load_export(output_dir)[0])
    report_run_end(recipe, trainer.state, run.source.path, output_dir, ExportCheck.from_logit_diff(logit_diff),
                   summary.mlflow_run_id, run.hub_push)
    print(summary.closing_line(report), flush=True)
    return report
