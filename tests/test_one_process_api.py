"""A plain one-process Python session calling `sft_recipes.train()`: what it imports and which config it can pass.

The run itself on that config (2 steps of recipes/tiny/llama8b.yaml, export check passed) was run by hand; this
file checks what decides whether the call can start, without launching a run."""

import pytest

from conftest import CPU_CONFIG


def test_package_exports_recipe_error():
    from sft_recipes import RecipeError as exported
    from sft_recipes.errors import RecipeError

    assert exported is RecipeError


def test_shipped_one_process_config_is_accepted_for_world_one():
    from sft_recipes.in_process import accelerate_launch_environment

    assert accelerate_launch_environment("accelerate_configs/cpu_1process.yaml", 1) == {
        "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "True"}


def test_two_process_config_in_one_process_names_the_shipped_one():
    from sft_recipes.errors import RecipeError
    from sft_recipes.in_process import accelerate_launch_environment

    with pytest.raises(RecipeError, match=r"accelerate_configs/cpu_1process\.yaml for one process"):
        accelerate_launch_environment(str(CPU_CONFIG), 1)
