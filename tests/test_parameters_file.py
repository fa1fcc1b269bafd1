"""HYPERPARAMETERS_PATH (an AI Runtime workload's `parameters:` block) as recipe overrides.

Precedence recipe < parameters < command line, exactly the checks of `--key value`, every problem at
once naming the file, and the refusals of scripts/sft.py at parse time (one `error:` line, exit 2).
"""

from __future__ import annotations

import pytest
import yaml

from conftest import TINY_LLAMA_RECIPE, bin_path, run_command
from sft_recipes.batching import derive_gradient_accumulation
from sft_recipes.config import PARAMETERS_ENV, load_recipe
from sft_recipes.errors import RecipeError
from sft_recipes.reporting.export_check import ExportCheck
from sft_recipes.reporting.summary import RunSummaryCallback


@pytest.fixture
def parameters(tmp_path, monkeypatch):
    """Write a parameters file and point HYPERPARAMETERS_PATH at it; returns its path."""
    path = tmp_path / "parameters.yaml"

    def write(content) -> str:
        path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
        monkeypatch.setenv(PARAMETERS_ENV, str(path))
        return str(path)

    return write


def test_precedence_recipe_then_parameters_then_command_line(parameters):
    parameters({"max_steps": 7, "learning_rate": 0.1, "output_dir": "/Volumes/main/default/ckpt/llama"})
    recipe = load_recipe(TINY_LLAMA_RECIPE, ["--max_steps", "5", "--seed", "3"])
    assert recipe.training.max_steps == 5  # the command line wins over the parameters file
    assert recipe.training.learning_rate == 0.1  # the parameters file wins over the recipe's 3e-3
    assert recipe.training.output_dir == "/Volumes/main/default/ckpt/llama"
    assert recipe.training.seed == 3 and recipe.training.save_steps == 15  # the recipe's own value
    assert recipe.overrides == {
        "parameters": {"max_steps": 7, "learning_rate": 0.1, "output_dir": "/Volumes/main/default/ckpt/llama"},
        "command_line": {"max_steps": 5, "seed": 3},
    }


def test_a_later_global_batch_replaces_an_earlier_fixed_accumulation(parameters):
    from sft_recipes.lint import LintContext, batch_the_world_cannot_produce

    # The tiny twin fixes gradient_accumulation_steps: 2; a stated global batch from the command line replaces it.
    recipe = load_recipe(TINY_LLAMA_RECIPE, ["--global_batch_size", "16"])
    assert "gradient_accumulation_steps" not in recipe.values and recipe.training.global_batch_size == 16
    assert batch_the_world_cannot_produce(recipe, LintContext(2, False)) is None
    assert derive_gradient_accumulation(recipe.training, 2)[0] == 2  # 16 = 4 per device x 2 processes x 2
    # From the parameters file too; the command line's global batch then replaces the file's (the run logs which).
    parameters({"global_batch_tokens": 4096})
    recipe = load_recipe(TINY_LLAMA_RECIPE)
    assert "gradient_accumulation_steps" not in recipe.values and recipe.training.global_batch_tokens == 4096
    recipe = load_recipe(TINY_LLAMA_RECIPE, ["--global_batch_size", "8"])
    assert recipe.training.global_batch_tokens is None and recipe.overrides == {"command_line": {"global_batch_size": 8}}


def test_a_later_fixed_accumulation_beside_a_stated_global_batch_stays_refused(parameters):
    from sft_recipes.lint import LintContext, batch_the_world_cannot_produce

    parameters({"global_batch_size": 16})
    recipe = load_recipe(TINY_LLAMA_RECIPE, ["--gradient_accumulation_steps", "4"])
    assert recipe.values["global_batch_size"] == 16 and recipe.values["gradient_accumulation_steps"] == 4
    assert batch_the_world_cannot_produce(recipe, LintContext(2, False)).startswith(
        "global_batch_size: 16 (HYPERPARAMETERS_PATH) and gradient_accumulation_steps: 4 (command line) are both set")


def test_without_the_variable_or_with_an_empty_block_nothing_is_overridden(parameters, monkeypatch):
    monkeypatch.delenv(PARAMETERS_ENV, raising=False)
    assert load_recipe(TINY_LLAMA_RECIPE).overrides == {}
    parameters("")  # `parameters:` with nothing under it
    recipe = load_recipe(TINY_LLAMA_RECIPE, {"max_steps": 2}, overrides_source="keyword_arguments")
    assert recipe.training.max_steps == 2 and recipe.overrides == {"keyword_arguments": {"max_steps": 2}}


def test_parameters_get_the_command_line_checks_all_at_once(parameters):
    path = parameters({"per_device_batch_size": 4, "max_steps": "many", "learning_rate": -1.0, "seed": 1})
    with pytest.raises(RecipeError) as err:
        load_recipe(TINY_LLAMA_RECIPE, ["--max_length", "0"])
    message = str(err.value)
    assert "\n" not in message
    origin = f"(set in HYPERPARAMETERS_PATH={path})"
    assert f"unknown key 'per_device_batch_size' {origin}; did you mean " in message
    assert "'per_device_train_batch_size'" in message
    assert f"'max_steps' must be an integer, got 'many' (str) {origin}" in message
    assert "'learning_rate' must be " in message and f"got -1.0 {origin}" in message
    assert "'max_length' must be" in message and "got 0" in message
    assert message.count(origin) == 3  # the command line's bad value does not name the file


def test_the_seeds_parameter_names_are_refused_with_ours(parameters):
    # Seed 000's `parameters:` block, written for its own train.py: none of its renamed keys passes silently.
    path = parameters({"model_name": "meta-llama/Llama-3.1-8B", "max_seq_len": 1024, "per_device_batch_size": 4,
                       "max_steps": 100})
    with pytest.raises(RecipeError) as err:
        load_recipe(TINY_LLAMA_RECIPE)
    for key in ("model_name", "max_seq_len", "per_device_batch_size"):
        assert f"unknown key '{key}' (set in HYPERPARAMETERS_PATH={path})" in str(err.value)
    assert "'max_steps' (set in" not in str(err.value) and "'max_steps' must" not in str(err.value)


@pytest.mark.parametrize("content, expected", [
    (None, "names no file: point it at the YAML of the workload's `parameters:` block, or unset HYPERPARAMETERS_PATH"),
    ("- max_steps: 5\n", "must be a mapping of recipe key: value (the workload's `parameters:` block), got list"),
    ("max_steps: [5\n", "is not valid YAML"),
])
def test_a_parameters_file_that_cannot_be_read_is_one_refusal(parameters, monkeypatch, tmp_path, content, expected):
    if content is None:
        monkeypatch.setenv(PARAMETERS_ENV, str(tmp_path / "absent.yaml"))
    else:
        parameters(content)
    with pytest.raises(RecipeError, match="HYPERPARAMETERS_PATH=") as err:
        load_recipe(TINY_LLAMA_RECIPE)
    assert expected in str(err.value)


def test_summary_and_mlflow_tags_record_the_overrides():
    overrides = {"parameters": {"max_steps": 7}, "command_line": {"seed": 3}}
    report = RunSummaryCallback(None, overrides=overrides).finish(1.0, "out", ExportCheck("skipped"), None,
                                                                  "NO over 1 process(es)")
    assert report["overrides"] == overrides


@pytest.mark.parametrize("content, expected", [
    ({"max_stepz": 5}, "unknown key 'max_stepz' (set in HYPERPARAMETERS_PATH={path}); did you mean 'max_steps'"),
    (None, "HYPERPARAMETERS_PATH={path} names no file"),
    ("max_steps: [5\n", "HYPERPARAMETERS_PATH={path} is not valid YAML: while parsing a flow sequence"),
])
def test_scripts_sft_refuses_at_parse_with_one_line_and_exit_2(tmp_path, content, expected):
    path = tmp_path / "parameters.yaml"
    if content is not None:
        path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    result = run_command([bin_path("python"), "scripts/sft.py", str(TINY_LLAMA_RECIPE), "--max_steps", "1",
                          "--output_dir", str(tmp_path / "out")], env={PARAMETERS_ENV: str(path)}, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected.format(path=path) in errors[0], result.stderr[-3000:]
    assert errors[0].endswith("Fix the YAML at the line and column named (one `key: value` per line).") \
        or "is not valid YAML" not in errors[0]
    assert "column" not in result.stderr.replace(errors[0], "")  # PyYAML's report is in the line, not below it
    assert not (tmp_path / "out").exists()  # refused before anything was written
