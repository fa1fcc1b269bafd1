"""The end of a run: export (consolidated checkpoint or adapter), the reload check, the summary."""

from __future__ import annotations

import json
from pathlib import Path

from sft_recipes.architectures.sequence_parallel import sequence_parallel_suspended
from sft_recipes.export import export_run
from sft_recipes.run.setup import Run
from sft_recipes.run.training import Training


def finish(run: Run, training: Training) -> dict | None:
    """Export and check the result (collective), then on rank 0 write run_summary.json and print the closing
    line. Returns the summary on rank 0."""
    with sequence_parallel_suspended():  # the reload check runs its probe whole on every rank
        output_dir, logit_diff = export_run(training.trainer, run.recipe.model, run.recipe.training.output_dir,
                                            load_base=run.source.load_model)
    if not run.is_main:
        return None
    summary = training.summary
    report = summary.finish(training.seconds, output_dir, logit_diff, training.resumed_from, training.layout)
    Path(output_dir, "run_summary.json").write_text(json.dumps(report, indent=2))
    print(summary.closing_line(report), flush=True)
    return report
