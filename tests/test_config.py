"""Recipe parsing: every bad input is one clear error, before anything heavy happens."""

from __future__ import annotations

import pytest
import yaml

from sft_recipes.config import RecipeError, load_recipe, parse_cli_overrides

BASE = {
    "model_name_or_path": "tiny:llama",
    "dataset_name": "data/samples/alpaca.jsonl",
    "dataset_format": "alpaca",
    "output_dir": "outputs/x",
    "use_cpu": True,
    "bf16": False,
    "learning_rate": 2.0e-5,
}


def write_recipe(tmp_path, **changes):
    values = {**BASE, **changes}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in values.items() if v is not ...}))
    return path


def test_keys_land_in_their_dataclass(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, per_device_train_batch_size=3, fsdp_reduce_dtype="bfloat16"))
    assert recipe.model.model_name_or_path == "tiny:llama"
    assert recipe.data.dataset_format == "alpaca"
    assert recipe.training.per_device_train_batch_size == 3
    assert recipe.training.learning_rate == 2.0e-5
    assert recipe.training.fsdp_reduce_dtype == "bfloat16"


def test_unknown_key_names_the_closest_valid_keys(tmp_path):
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(tmp_path, learnig_rate=1e-4, per_device_batch_size=2))
    message = str(err.value)
    assert "unknown key 'learnig_rate'; did you mean 'learning_rate'" in message
    assert "unknown key 'per_device_batch_size'; did you mean" in message
    assert "'per_device_train_batch_size'" in message.split("per_device_batch_size")[1]


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("max_steps", "ten", "'max_steps' must be an integer, got 'ten'"),
        ("bf16", "yes please", "'bf16' must be true or false"),
        ("dataset_format", "sharegpt", "'dataset_format' must be one of ['alpaca', 'messages'"),
        ("learning_rate", [1, 2], "'learning_rate' must be a number"),
    ],
)
def test_wrong_type_is_a_clear_error(tmp_path, key, value, expected):
    with pytest.raises(RecipeError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        load_recipe(write_recipe(tmp_path, **{key: value}))


def test_yaml_exponent_without_dot_is_still_a_number(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**BASE}).replace("learning_rate: 2.0e-05", "learning_rate: 2e-5"))
    assert load_recipe(path).training.learning_rate == 2e-5


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="Recipe file not found: .*nope.yaml"):
        load_recipe(tmp_path / "nope.yaml")


def test_cli_overrides_win_and_are_typed(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path), ["--max_steps", "7", "--learning_rate=3e-4", "--bf16", "false"])
    assert recipe.training.max_steps == 7
    assert recipe.training.learning_rate == 3e-4
    assert recipe.training.bf16 is False


def test_cli_override_of_unknown_key_is_rejected(tmp_path):
    with pytest.raises(RecipeError, match="unknown key 'max_step'; did you mean 'max_steps'"):
        load_recipe(write_recipe(tmp_path), ["--max_step", "7"])


def test_bare_flag_means_true_and_positional_junk_is_rejected():
    assert parse_cli_overrides(["--use_cpu"]) == {"use_cpu": True}
    with pytest.raises(RecipeError, match="Unexpected argument 'stray'"):
        parse_cli_overrides(["stray"])


def test_environment_interpolation(tmp_path, monkeypatch):
    monkeypatch.setenv("UC_CATALOG", "prod")
    monkeypatch.delenv("UC_SCHEMA", raising=False)
    monkeypatch.setenv("STEPS", "12")
    path = write_recipe(tmp_path, output_dir="/Volumes/${UC_CATALOG:-main}/${UC_SCHEMA:-default}/ckpt", max_steps="${STEPS}")
    recipe = load_recipe(path)
    assert recipe.training.output_dir == "/Volumes/prod/default/ckpt"
    assert recipe.training.max_steps == 12


def test_unset_variable_without_default_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("NO_SUCH_VAR", raising=False)
    with pytest.raises(RecipeError, match="NO_SUCH_VAR are not set"):
        load_recipe(write_recipe(tmp_path, output_dir="/x/${NO_SUCH_VAR}"))


def test_secrets_are_refused_in_recipes(tmp_path):
    with pytest.raises(RecipeError, match="'hub_token' must not be written in a recipe: set the HF_TOKEN"):
        load_recipe(write_recipe(tmp_path, hub_token="hf_abc"))


def test_all_problems_are_reported_at_once(tmp_path):
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(tmp_path, max_steps="x", bogus_key=1))
    assert "'max_steps' must be an integer" in str(err.value) and "unknown key 'bogus_key'" in str(err.value)
