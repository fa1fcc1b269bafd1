"""A refusal the user can fix is one `error:` line naming the problem and the fix, exit 2, no traceback."""

from __future__ import annotations

import re
import sys

import pytest

from conftest import REPO_ROOT, TINY_LLAMA_RECIPE, bin_path, launch_sft, run_command
from sft_recipes.errors import REFUSED_EXIT_CODE, RecipeError, one_line_refusals


def _own_traceback(stderr: str) -> bool:
    """A Python traceback through this project's code (the launcher's own report is not ours)."""
    return re.search(r'File "[^"]*(sft_recipes/|scripts/sft\.py)[^"]*", line', stderr) is not None


def test_a_recipe_error_becomes_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")

    def refuse() -> int:
        raise RecipeError("output_dir x holds checkpoints of another recipe: use another output_dir")

    assert one_line_refusals(refuse) == REFUSED_EXIT_CODE
    assert capsys.readouterr().err == "error: output_dir x holds checkpoints of another recipe: use another output_dir\n"


def test_the_refusal_line_starts_a_line_of_its_own_after_an_open_progress_bar(capsys, monkeypatch):
    """A bar still drawing ends its line in a carriage return: the `error:` line goes below it, not over it."""
    from tqdm import tqdm  # datasets' and transformers' bars are its subclasses (an earlier test may turn theirs off)

    monkeypatch.setenv("RANK", "0")
    bar = tqdm(total=4, desc="Tokenizing", file=sys.stderr, disable=False)
    try:
        assert one_line_refusals(lambda: (_ for _ in ()).throw(RecipeError("bad"))) == REFUSED_EXIT_CODE
    finally:
        bar.close()
    before, _ = capsys.readouterr().err.split("error: bad\n")
    last_frame = before.rsplit("\r", 1)[-1]  # a bar redraws its line after a carriage return
    assert last_frame.startswith("Tokenizing:") and last_frame.endswith("it/s]\n"), before


@pytest.mark.parametrize("rank, printed", [("0", "error: unrecognized arguments: --stepz 3 (see scripts/x.py --help)\n"),
                                            ("1", "")])
def test_a_wrong_command_line_is_one_line_from_rank_0_and_exit_2(capsys, monkeypatch, rank, printed):
    from sft_recipes.command_line import OneLineParser

    monkeypatch.setenv("RANK", rank)
    parser = OneLineParser(prog="scripts/x.py")
    parser.add_argument("--steps", type=int)
    with pytest.raises(SystemExit) as refused:
        parser.parse_args(["--stepz", "3"])
    assert (refused.value.code, capsys.readouterr()) == (2, ("", printed))


def test_only_rank_0_prints_the_refusal(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert one_line_refusals(lambda: (_ for _ in ()).throw(RecipeError("bad"))) == REFUSED_EXIT_CODE
    assert capsys.readouterr().err == ""


def test_a_bug_still_shows_its_traceback():
    with pytest.raises(ZeroDivisionError):
        one_line_refusals(lambda: 1 // 0)


def test_a_missing_dataset_is_one_line(tmp_path):
    result = run_command([bin_path("python"), "scripts/sft.py", str(TINY_LLAMA_RECIPE),
                          "--dataset_name", "data/samples/nope.jsonl", "--output_dir", str(tmp_path / "out")])
    assert result.returncode == REFUSED_EXIT_CODE, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: Dataset file not found: data/samples/nope.jsonl (dataset_name). Check the path "
                      f"relative to {REPO_ROOT}."]
    assert not _own_traceback(result.stderr)
    assert result.stderr.strip().splitlines()[-1] == errors[0]  # the last thing the process wrote
    # nothing but the log of the refusal: the console as it was, the error line last
    assert [path.name for path in (tmp_path / "out").iterdir()] == ["train.log"]
    assert (tmp_path / "out" / "train.log").read_text().splitlines()[-1] == errors[0]


@pytest.mark.fsdp
@pytest.mark.parametrize("override, first_words", [
    (("--dataset_name", "data/samples/nope.jsonl"), "error: Dataset file not found: data/samples/nope.jsonl"),
    (("--max_stepz", "3"), "error: "),  # a typo: refused at parse, the earliest point
])
def test_under_accelerate_launch_one_rank_prints_and_every_rank_exits_2(tmp_path, override, first_words):
    result = launch_sft(TINY_LLAMA_RECIPE, *override, "--output_dir", str(tmp_path / "out"), check=False,
                        launcher="real")  # the exit codes through torchrun itself (docs/testing.md)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(first_words), errors
    # torchrun's report: every rank refused, none was stopped by torchrun (SIGTERM, -15) once the first one had
    codes = re.findall(r"exitcode  : (-?\d+)", result.stderr)
    assert codes == ["2", "2"], codes
    assert not _own_traceback(result.stderr)
    if first_words == "error: ":  # refused while parsing the recipe: no output_dir yet, so no train.log
        assert not (tmp_path / "out").exists()
        return
    # below torchrun's report, train.log has rank 0's console and every rank's refusal (none is stopped first)
    log = (tmp_path / "out" / "train.log").read_text().splitlines()
    assert errors[0] in log and "ChildFailedError" not in "\n".join(log)
    assert [line for line in log if line.startswith("[rank ")] == [f"[rank 1] {errors[0]}"], log


@pytest.mark.fsdp
def test_a_wrong_option_of_the_script_is_one_line_and_exit_2_on_every_rank(tmp_path):
    """argparse's own refusal was its usage block and `sft.py: error: ...` from every rank."""
    result = launch_sft(TINY_LLAMA_RECIPE, "--audit-data", "0", "--output_dir", str(tmp_path / "out"), check=False)
    assert [line for line in result.stderr.splitlines() if line.startswith(("error", "usage", "sft.py"))] == [
        "error: argument --audit-data: 0 is not a whole number >= 1: give how many conversations to show"]
    assert re.findall(r"exitcode  : (-?\d+)", result.stderr) == ["2", "2"]
    assert not (tmp_path / "out").exists()


def _refusal(path, overrides=()) -> str:
    from sft_recipes.config import load_recipe

    with pytest.raises(RecipeError) as err:
        load_recipe(path, list(overrides))
    return str(err.value)


def test_the_most_common_refusals_end_with_what_to_do(tmp_path):
    """The problem first, the fix last: the end of the line is what a user reads after a wall of logs."""
    message = _refusal(tmp_path / "nope.yaml")
    assert message.startswith(f"Recipe file not found: {tmp_path / 'nope.yaml'}. Pass the path of a recipe YAML: one of ")
    shipped = sorted(path.relative_to(REPO_ROOT).as_posix() for path in (REPO_ROOT / "recipes").rglob("*.yaml"))
    assert message.endswith(", ".join(shipped) + ".")
    broken = tmp_path / "broken.yaml"
    broken.write_text("max_steps: 4\n  learning_rate: 1\n")
    assert _refusal(broken).endswith("Fix the YAML at the line and column named (one `key: value` per line).")
    message = _refusal(TINY_LLAMA_RECIPE, ["--zzz_unheard_of", "1", "--learning_rate", "-1"])
    assert "unknown key 'zzz_unheard_of' (set by --zzz_unheard_of): remove it, or use a field of DataArguments" \
        in message
    assert "'learning_rate' must be a finite number > 0, got -1.0 (set by --learning_rate)" in message
    assert message.endswith(f"Fix each where it is set (in parentheses), else in {TINY_LLAMA_RECIPE}.")
    # A problem in the recipe file alone names only the file.
    in_the_file = tmp_path / "in_the_file.yaml"
    in_the_file.write_text(TINY_LLAMA_RECIPE.read_text() + "\nlearning_rate: -1\n")
    message = _refusal(in_the_file, ["--max_steps", "3"])
    assert message == (f"{in_the_file}: 'learning_rate' must be a finite number > 0, got -1.0. "
                       f"Fix these in {in_the_file}.")
    # The example: an alpaca source in a packed mixture says what to change.
    message = _refusal(TINY_LLAMA_RECIPE, ["--pack_blocks", "true", "--datasets",
                                            "[{path: data/samples/alpaca.jsonl, dataset_format: alpaca}]",
                                            "--dataset_name", "null"])
    assert "has dataset_format 'alpaca'; pack_blocks packs chat conversations (alpaca_chat or messages or " in message
    assert "): set pack_blocks: false, or dataset_format: alpaca_chat on this source (its rows as chat conversations)" \
        in message
    assert message.endswith("Fix it where it is set: pack_blocks (set by --pack_blocks), datasets (set by --datasets); "
                            f"else in {TINY_LLAMA_RECIPE}.")
    # transformers' own refusals: its lines joined into one, and the override named by the value it quotes.
    message = _refusal(TINY_LLAMA_RECIPE, ["--lr_scheduler_type", "nope", "--max_steps", "3"])
    assert "TrainingArguments rejected the recipe: nope is not a valid SchedulerType" in message
    assert message.endswith(f"Fix it where it is set: lr_scheduler_type (set by --lr_scheduler_type); "
                            f"else in {TINY_LLAMA_RECIPE}.")
    message = _refusal(TINY_LLAMA_RECIPE, ["--load_best_model_at_end", "true", "--save_strategy", "epoch"])
    assert "\n" not in message
    assert "but found - Evaluation strategy: IntervalStrategy.NO - Save strategy: SaveStrategy.EPOCH." in message
    assert message.endswith("Fix it where it is set: load_best_model_at_end (set by --load_best_model_at_end), "
                            f"save_strategy (set by --save_strategy); else in {TINY_LLAMA_RECIPE}.")
    in_the_file.write_text(TINY_LLAMA_RECIPE.read_text() + "\nlr_scheduler_type: nope\n")
    message = _refusal(in_the_file, ["--max_steps", "3"])
    assert message.endswith(f"Fix that key in {in_the_file}.")


def test_train_says_a_missing_recipe_is_missing_before_looking_for_its_header(tmp_path):
    from sft_recipes import train

    with pytest.raises(RecipeError, match=r"^Recipe file not found: nope\.yaml\. Pass the path of a recipe YAML"):
        train("nope.yaml")
    headless = tmp_path / "headless.yaml"
    headless.write_text("max_steps: 1\n")
    with pytest.raises(RecipeError, match=r"headless\.yaml names no accelerate config in its header: pass "
                                          r"train\(\.\.\., accelerate_config="):
        train(headless)
