"""Every command the README's user sections print runs as printed, from a fresh shell with no venv activated.

The sections before "## Recipes" (the two first commands and the quickstart) are read block by block;
each command is run in its cheapest honest form: `make X ...` as `make -n` (the target and its
variables exist) with the preflight it would run executed for real (the recipe and overrides pass),
`--dry-run` / `--audit-data` commands as they are, any other script with `--help`. Elsewhere in the
README and docs/, no command may start with a bare `python`, `accelerate` or `pip` (outside the venv
those are not ours: `ModuleNotFoundError: No module named 'torch'`).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT, run_command

USER_SECTIONS_END = "\n## Recipes\n"
VENV_BIN = Path(sys.executable).parent


def bash_commands(markdown: str) -> list[str]:
    """The commands of the ```bash blocks: comments dropped, continuation lines joined."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+#.*$", "", command).strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def fresh_shell_env() -> dict[str, str]:
    """PATH without this venv; PYTHONPATH kept (a worktree's checkout of src/ may differ from the install)."""
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if Path(p).resolve() != VENV_BIN.resolve())
    return {"PATH": path, "VIRTUAL_ENV": ""}


USER_COMMANDS = bash_commands((REPO_ROOT / "README.md").read_text().split(USER_SECTIONS_END)[0])


def test_the_user_sections_print_the_commands_this_test_runs():
    assert USER_COMMANDS[:2] == ["make demo", "make test"]
    assert any("--dry-run" in c for c in USER_COMMANDS) and any(c.startswith("make chat") for c in USER_COMMANDS)


def _run(words: list[str], renamed: dict[str, str]):
    words = [renamed.get(word, word) for word in words]
    for old, new in renamed.items():  # inside KEY=value words too
        words = [word.replace(f"={old}", f"={new}") for word in words]
    return run_command(words, env=fresh_shell_env(), timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("command", USER_COMMANDS)
def test_every_command_of_the_user_sections_runs_as_printed(command, tmp_path):
    assert (REPO_ROOT / ".venv" / "bin" / "python").exists(), "the README's commands run .venv/bin/python: make setup"
    words = shlex.split(command)
    assert words[0] in ("make", "cp", ".venv/bin/python"), f"{command!r} would not run from a fresh shell"
    renamed = {}
    if words[0] == "cp":  # the copy goes to a scratch folder, and the commands after it read it from there
        source, target = words[1:]
        assert (REPO_ROOT / source).is_file(), source
        return
    for earlier in USER_COMMANDS[:USER_COMMANDS.index(command)]:
        if earlier.startswith("cp "):
            source, target = shlex.split(earlier)[1:]
            shutil.copy(REPO_ROOT / source, tmp_path / target)
            renamed[target] = str(tmp_path / target)
    if words[0] == "make":
        # -o: a venv exists (this one); a fresh checkout's timestamps must not make it rebuild it
        result = _run(["make", "-n", "-o", ".venv/.installed", "-o", ".venv/.installed-test", *words[1:]], renamed)
        assert result.returncode == 0, result.stderr
        for line in result.stdout.splitlines():
            if "sft_recipes.preflight_launch" in line:  # what the target checks before starting anything
                checked = _run(shlex.split(line), {})
                assert checked.returncode == 0, f"{line}\n{checked.stderr[-2000:]}"
            elif line.startswith(".venv/bin/python scripts/"):
                assert (REPO_ROOT / shlex.split(line)[1]).is_file(), line
        return
    if not {"--dry-run", "--audit-data"} & set(words):
        words = words[:2] + ["--help"]
    result = _run(words, renamed)
    assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"


def test_no_page_prints_a_command_that_needs_an_activated_venv():
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    bare = [(page.name, command) for page in pages for command in bash_commands(page.read_text())
            if re.match(r"(\w+=\S+\s+)*(python3?|accelerate|pip|pytest|mlflow)\s", command)]
    assert not bare, bare


PLANNING_PAGES = ("planner.md", "planning.md")
PLANNING_COMMANDS = [command for page in PLANNING_PAGES for command in bash_commands((REPO_ROOT / "docs" / page).read_text())]


def test_the_planning_pages_plan_from_the_shipped_model_configs_offline():
    """A real recipe's Hub id is not in a clone's Hugging Face cache: a dry run of it printed without
    --model_name_or_path failed offline ('meta-llama/Llama-3.1-8B is not in the Hugging Face cache')."""
    assert len(PLANNING_COMMANDS) == 4, PLANNING_COMMANDS
    for command in PLANNING_COMMANDS:
        words = shlex.split(command)
        assert words[:2] == [".venv/bin/python", "scripts/sft.py"] and "--dry-run" in words, command
        model = words[words.index("--model_name_or_path") + 1] if "--model_name_or_path" in words else None
        assert model and model.startswith("data/realworld/model_configs/") and (REPO_ROOT / model).is_file(), command


@pytest.mark.slow
@pytest.mark.parametrize("command", PLANNING_COMMANDS)
def test_every_command_of_the_planning_pages_runs_as_printed(command):
    result = _run(shlex.split(command), {})
    assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
