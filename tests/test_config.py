"""Recipe parsing: every bad input is one clear error, before anything heavy happens."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml

from sft_recipes.config import RECIPE_DATACLASSES, RecipeError, _type_hints, load_recipe, parse_cli_overrides
from sft_recipes.value_ranges import RANGES, UNCHECKED

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
    assert "?." not in message  # the last 'did you mean ...?' ends its own sentence


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("max_steps", "ten", "'max_steps' must be an integer, got 'ten'"),
        ("bf16", "yes please", "'bf16' must be true or false"),
        ("dataset_format", "openai_chat", "'dataset_format' must be one of ['alpaca', 'alpaca_chat', 'messages'"),
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
    with pytest.raises(RecipeError, match="unknown key 'max_step' \\(set by --max_step\\); did you mean 'max_steps'"):
        load_recipe(write_recipe(tmp_path), ["--max_step", "7"])


def test_an_override_that_is_not_yaml_is_one_refusal_naming_the_key():
    with pytest.raises(RecipeError) as refused:
        parse_cli_overrides(["--eval_max_regression", "{alpaca_answers: 0.1"])
    assert str(refused.value) == (
        "--eval_max_regression '{alpaca_answers: 0.1' is not a YAML value (expected ',' or '}', but got '<stream end>'): "
        "quote the value as one shell word and close its brackets, e.g. --eval_max_regression '{gsm8k_local: 0.02}'.")


def test_an_unquoted_no_is_transformers_no_strategy_in_a_file_and_on_the_command_line(tmp_path):
    # YAML 1.1 reads `no` and `off` as false; transformers documents `save_strategy: no`
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(BASE) + "save_strategy: no\neval_strategy: off\n")
    recipe = load_recipe(path, ["--logging_strategy", "no"])
    assert (recipe.training.save_strategy, recipe.training.eval_strategy, recipe.training.logging_strategy) == (
        "no", "no", "no")
    with pytest.raises(RecipeError, match=r"'save_strategy' must be one of \['no', 'steps', 'epoch', 'best'\].*True"):
        load_recipe(path, ["--save_strategy", "yes"])  # true names no choice


def test_bare_flag_means_true_and_positional_junk_is_rejected():
    assert parse_cli_overrides(["--use_cpu"]) == {"use_cpu": True}
    with pytest.raises(RecipeError, match="Unexpected argument 'stray'"):
        parse_cli_overrides(["stray"])


def test_several_words_after_a_key_are_a_list_as_trl_reads_them():
    assert parse_cli_overrides(["--lora_target_modules", "q_proj", "v_proj", "--max_steps", "3", "--use_peft"]) == {
        "lora_target_modules": ["q_proj", "v_proj"], "max_steps": 3, "use_peft": True}
    assert parse_cli_overrides(["--lora_target_modules=q_proj", "--eval_tasks", "[alpaca_answers]"]) == {
        "lora_target_modules": "q_proj", "eval_tasks": ["alpaca_answers"]}


def test_one_value_for_a_list_key_is_a_list_of_it(tmp_path):
    # TRL's parser reads `--lora_target_modules all-linear` as [all-linear]; a recipe may write one value too.
    path = write_recipe(tmp_path, eval_tasks="alpaca_answers")
    recipe = load_recipe(path, ["--lora_target_modules", "all-linear"])
    assert recipe.model.lora_target_modules == "all-linear"  # TRL's ModelConfig keeps one module as peft takes it
    assert recipe.training.eval_tasks == ["alpaca_answers"]
    assert load_recipe(path, ["--lora_target_modules", "q_proj", "v_proj"]).model.lora_target_modules == [
        "q_proj", "v_proj"]
    with pytest.raises(RecipeError) as refused:  # a value the list's items cannot be, and words for a scalar key
        load_recipe(path, ["--eval_tasks", "3", "--max_steps", "3", "4"])
    assert str(refused.value) == (
        f"{path}: 'eval_tasks' must be a list, got 3 (int) (set by --eval_tasks); 'max_steps' must be an integer, got "
        f"[3, 4] (list) (set by --max_steps). Fix each where it is set (in parentheses), else in {path}.")


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


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("max_length", 0, "'max_length' must be an integer >= 1 (tokens per sequence; null for no limit), got 0"),
        ("max_length", -1, "'max_length' must be an integer >= 1 (tokens per sequence; null for no limit), got -1"),
        ("learning_rate", float("nan"), "'learning_rate' must be a finite number > 0, got nan"),
        ("learning_rate", float("inf"), "'learning_rate' must be a finite number > 0, got inf"),
        ("learning_rate", -1.0, "'learning_rate' must be a finite number > 0, got -1.0"),
        ("max_steps", 0, "'max_steps' must be an integer >= 1 or -1 (-1: train num_train_epochs), got 0"),
        ("max_dropped_share", 1.5, "'max_dropped_share' must be a finite number in [0, 1], got 1.5"),
        ("lora_rank_pattern", {"mlp.experts.down_proj": 0}, "'lora_rank_pattern['mlp.experts.down_proj']' must be an integer >= 1, got 0"),
    ],
)
def test_number_outside_its_range_is_named_with_the_range(tmp_path, key, value, expected):
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(tmp_path, **{key: value}))
    assert expected in str(err.value)


def test_nan_from_the_command_line_is_refused(tmp_path):
    with pytest.raises(RecipeError, match="'learning_rate' must be a finite number > 0, got nan"):
        load_recipe(write_recipe(tmp_path), ["--learning_rate", "nan"])


def test_a_bare_flag_that_needs_a_value_says_so(tmp_path):
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(tmp_path), ["--max_steps", "--learning_rate", "1e-4"])  # the value was forgotten
    assert "'max_steps' must be an integer, got True (bool) (a bare --max_steps reads as true: give it a value)" \
        in str(err.value)
    with pytest.raises(RecipeError) as err:  # the same value written in the recipe file is no forgotten value
        load_recipe(write_recipe(tmp_path, max_steps=True))
    assert "'max_steps' must be an integer, got True (bool). Fix these in " in str(err.value)
    with pytest.raises(RecipeError) as err:  # a value written on the command line is no forgotten value either
        load_recipe(write_recipe(tmp_path), ["--max_steps", "true"])
    assert "'max_steps' must be an integer, got True (bool) (set by --max_steps). Fix each where" in str(err.value)


def test_resume_from_checkpoint_true_says_what_it_takes(tmp_path):
    """transformers' Trainer.train(resume_from_checkpoint=True) resumes; the recipe key is a string: auto does that."""
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(tmp_path), ["--resume_from_checkpoint", "true"])
    assert ("'resume_from_checkpoint' must be a string, got True (bool) (set by --resume_from_checkpoint): it takes "
            "auto (the default: the newest complete checkpoint in output_dir, else a fresh start), the path of a "
            "checkpoint-N folder, or null (no resume).") in str(err.value)


def test_a_problem_names_the_override_that_set_it(tmp_path):
    """The user fixes a value where they wrote it: the command line, train()'s keyword or the recipe file."""
    recipe = write_recipe(tmp_path, warmup_steps=-1)
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe, {"max_steps": "ten"}, overrides_source="keyword_arguments")
    assert str(err.value) == (
        f"{recipe}: 'warmup_steps' must be a finite number >= 0 (below 1: a fraction of the total steps), got -1.0; "
        "'max_steps' must be an integer, got 'ten' (str) (set by train(max_steps=...)). Fix each where it is set (in parentheses), "
        f"else in {recipe}.")


def test_every_range_problem_is_reported_at_once(tmp_path):
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(tmp_path, max_length=0, learning_rate=float("nan"), per_device_train_batch_size=0,
                                 adam_beta2=1.0, max_steps="x"))
    message = str(err.value)
    for key in ("max_length", "learning_rate", "per_device_train_batch_size", "adam_beta2"):
        assert f"'{key}' must be" in message, key
    assert "'max_steps' must be an integer, got 'x'" in message


def test_sentinels_and_boundaries_are_accepted(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, max_steps=-1, max_length=None, max_grad_norm=0.0, warmup_steps=0.03,
                                      max_dropped_share=0.0, lora_dropout=0.0))
    assert (recipe.training.max_steps, recipe.training.max_length, recipe.training.max_grad_norm) == (-1, None, 0.0)


def holds_numbers(annotation) -> bool:
    """int, float, or a type built from them (int | None, dict[str, int], ...)."""
    return annotation in (int, float) or any(holds_numbers(arg) for arg in typing.get_args(annotation))


def test_every_numeric_field_has_a_range_or_a_reason():
    numeric = {f.name for cls in RECIPE_DATACLASSES for f in dataclasses.fields(cls)
               if f.init and holds_numbers(_type_hints(cls)[f.name])}
    assert numeric - set(RANGES) - set(UNCHECKED) == set(), "give each new numeric field a range in value_ranges.py"
    assert set(RANGES) | set(UNCHECKED) <= numeric, "a range for a field that no longer exists"


def test_a_folder_as_the_recipe_is_named_as_a_folder_with_the_recipes_in_it(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "a.yaml").write_text("max_steps: 1\n")
    (tmp_path / "mine" / "more").mkdir()
    (tmp_path / "mine" / "more" / "b.yaml").write_text("max_steps: 1\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(tmp_path / "mine")
    assert str(err.value) == (f"{tmp_path / 'mine'} is a folder, not a recipe file. Pass the path of a recipe YAML: "
                              f"one of {(tmp_path / 'mine' / 'a.yaml').as_posix()}, "
                              f"{(tmp_path / 'mine' / 'more' / 'b.yaml').as_posix()}.")
