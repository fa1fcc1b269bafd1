"""A started run carried to its end: the steps every entry point shares (scripts/sft.py, `sft_recipes.train()`)."""

from __future__ import annotations

from sft_recipes.run.data import build_data
from sft_recipes.run.finish import RunResult, finish
from sft_recipes.run.model import build_model
from sft_recipes.run.setup import Run
from sft_recipes.run.training import build_trainer


def complete_run(run: Run) -> RunResult:
    """Tokenizer, data, model, trainer, training, finish (export, check, summary) -- in that order, on every rank."""
    tokenizer = run.source.load_tokenizer()
    data = build_data(run, tokenizer)
    model = build_model(run)
    training = build_trainer(run, data, model, tokenizer)
    training.run()
    return finish(run, training)
