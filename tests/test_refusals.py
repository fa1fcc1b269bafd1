"""A refusal the user can fix is one `error:` line naming the problem and the fix, exit 2, no traceback."""

from __future__ import annotations

import re

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
    assert capsys.readouterr().err == "\nerror: output_dir x holds checkpoints of another recipe: use another output_dir\n"


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
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.fsdp
@pytest.mark.parametrize("override, first_words", [
    (("--dataset_name", "data/samples/nope.jsonl"), "error: Dataset file not found: data/samples/nope.jsonl"),
    (("--max_stepz", "3"), "error: "),  # a typo: refused at parse, the earliest point
])
def test_under_accelerate_launch_one_rank_prints_and_every_rank_exits_2(tmp_path, override, first_words):
    result = launch_sft(TINY_LLAMA_RECIPE, *override, "--output_dir", str(tmp_path / "out"), check=False)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(first_words), errors
    # torchrun's report: every rank refused, none was stopped by torchrun (SIGTERM, -15) once the first one had
    codes = re.findall(r"exitcode  : (-?\d+)", result.stderr)
    assert codes == ["2", "2"], codes
    assert not _own_traceback(result.stderr)
