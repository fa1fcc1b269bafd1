"""After the export check: the export and the base model scored on the recipe's `eval_tasks`, and the gate.

Rank 0 scores both models (the same tasks and settings, each task cached by model, revision and task, so a
re-run scores the base once) while the other ranks wait for the outcome (run/outcome.py). A tuned model that fell
below the base by more than `eval_max_regression`, or an export that could not be scored, ends the run with one
`error:` line and exit 2 on every rank, after the export, its summary and its card are written: the export is
never lost.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sft_recipes.scores.compare import Comparison, compare, regression_refusal

logger = logging.getLogger("sft")


@dataclass(frozen=True)
class Benchmarks:
    """The comparison (empty when scoring failed), its settings, and why the run is refused (None: it is not)."""

    rows: list[Comparison]
    settings: dict[str, Any]
    refusal: str | None
    error: str | None = None  # scoring failed: what failed

    @property
    def regressed(self) -> bool:
        return any(row.regressed for row in self.rows)

    def as_summary(self) -> dict[str, Any]:
        return {"tasks": [row.as_dict() for row in self.rows], "settings": self.settings, "regressed": self.regressed,
                "error": self.error}


def wants_benchmarks(training) -> bool:
    return bool(training.eval_tasks)


def score_run(run, output_dir: str | Path) -> Benchmarks:
    """Rank 0: score the export in `output_dir` and the base model on the recipe's tasks, compare, apply the gate."""
    from sft_recipes.reporting.load_export import load_export
    from sft_recipes.scores.harness import EvalSettings, model_key, score_model
    from sft_recipes.scores.tasks import parse_tasks

    training, model_args = run.recipe.training, run.recipe.model
    tasks = parse_tasks(training.eval_tasks, training.eval_limit, training.eval_num_fewshot)  # linted before training
    settings = EvalSettings(batch_size=training.per_device_eval_batch_size, max_gen_toks=training.eval_max_gen_toks,
                            apply_chat_template=training.eval_apply_chat_template, seed=training.seed)
    described = {"limit": training.eval_limit, "num_fewshot": training.eval_num_fewshot,
                 "max_gen_toks": settings.max_gen_toks, "apply_chat_template": settings.apply_chat_template,
                 "per_task": {task.name: {"limit": task.limit, "num_fewshot": task.num_fewshot} for task in tasks}}
    scored = "the export"
    try:
        model, tokenizer = load_export(output_dir)
        model = model.to(training.device)  # rank 0's device: its GPU on a GPU launch (a full copy of the model)
        model.config.use_cache = True  # generation tasks; the export saved the training setting (off)
        tuned = score_model(model, tokenizer, tasks, settings, training.eval_cache_dir, model_key(str(output_dir)))
        del model
        gc.collect()
        scored = f"the base model {model_args.model_name_or_path}"
        model, tokenizer = run.source.load_model().eval().to(training.device), run.source.load_tokenizer()
        model.config.use_cache = True
        base = score_model(model, tokenizer, tasks, settings, training.eval_cache_dir,
                           model_key(run.source.path, model_args.model_revision))
    except Exception as err:  # noqa: BLE001 -- any failure here must keep the export and end in one line
        logger.exception("benchmark scoring of %s failed", scored)
        error = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        return Benchmarks([], described, f"scoring {scored} on eval_tasks failed ({error}); the export in "
                          f"{output_dir} is kept and was not pushed: fix the task or the model, then score it with "
                          f"scripts/evaluate.py {output_dir} (train.log has the traceback)", error)
    rows = compare(base, tuned, training.eval_max_regression)
    return Benchmarks(rows, described, regression_refusal(rows, output_dir))
