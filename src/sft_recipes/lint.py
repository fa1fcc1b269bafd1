"""Cross-file checks run before anything loads: each rule names its fix; all problems at once."""

from __future__ import annotations

import os

from sft_recipes.config import Recipe, RecipeError


def _fsdp_activation_checkpointing() -> bool:
    return os.environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true"


def activation_checkpointing_twice(recipe: Recipe) -> str | None:
    if recipe.training.activation_checkpointing and _fsdp_activation_checkpointing():
        return (
            "activation checkpointing is on twice: in the accelerate config (fsdp_activation_checkpointing) and in "
            "the recipe (activation_checkpointing/gradient_checkpointing, which TRL turns on by default); set "
            "`activation_checkpointing: false` in the recipe and keep FSDP's"
        )
    return None


RULES = (activation_checkpointing_twice,)


def lint_recipe(recipe: Recipe) -> None:
    problems = [message for rule in RULES if (message := rule(recipe))]
    if problems:
        raise RecipeError(f"{recipe.source}: " + "; ".join(problems) + ".")
