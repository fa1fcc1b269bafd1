"""Every shipped notebook is Databricks notebook source whose Python cells compile and whose training call
names a shipped recipe, the accelerate config its header launches, and only recipe keys."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from sft_recipes.config import load_recipe, recipe_field_owners
from sft_recipes.launch import header_accelerate_config

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("*.py"))
CELL_SEPARATOR = "\n# COMMAND ----------\n"


def cells(path: Path) -> list[str]:
    text = path.read_text()
    assert text.startswith("# Databricks notebook source\n"), "Databricks imports only this header as a notebook"
    return [cell.strip("\n") for cell in text.removeprefix("# Databricks notebook source\n").split(CELL_SEPARATOR)]


def magic_lines(cell: str) -> list[str] | None:
    """The lines of a `# MAGIC` cell without the prefix; None for a Python cell."""
    lines = cell.splitlines()
    if not all(line.startswith("# MAGIC") for line in lines):
        return None
    return [line.removeprefix("# MAGIC").strip() for line in lines]


def constants(tree: ast.Module) -> dict[str, str]:
    return {node.targets[0].id: node.value.value for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def test_there_is_a_notebook():
    assert [path.name for path in NOTEBOOKS] == ["gptoss120b_serverless.py"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_installs_the_pinned_set_and_its_python_cells_compile(path):
    python, magics = [], []
    for cell in cells(path):
        (python if magic_lines(cell) is None else magics).append(cell)
    for cell in python:
        compile(cell, str(path), "exec")  # a SyntaxError names the cell's line
    pip = [line for cell in magics for line in magic_lines(cell) if line.startswith("%pip install")]
    assert "%pip install -r ../requirements.txt" in pip and (path.parent / "../requirements.txt").resolve().is_file()
    assert "%pip install --no-deps .." in pip  # the package itself, for the ranks to import
    assert any(line == "%restart_python" for cell in magics for line in magic_lines(cell))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_trains_a_shipped_recipe_with_its_header_config_from_a_distributed_function(path):
    tree = ast.parse("\n".join(cell for cell in cells(path) if magic_lines(cell) is None))
    names = constants(tree)
    recipe, config = REPO_ROOT / names["RECIPE"], REPO_ROOT / names["ACCELERATE_CONFIG"]
    assert recipe.is_file() and config.is_file()
    assert header_accelerate_config(recipe).resolve() == config.resolve()  # what its launch command uses
    load_recipe(recipe, planning=True)

    decorated = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.decorator_list]
    assert len(decorated) == 1
    function = decorated[0]
    decorator = function.decorator_list[0]
    assert ast.unparse(decorator) == "distributed(gpus=8, gpu_type='H100')"
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert any(node.module == "serverless_gpu" and node.names[0].name == "distributed" for node in imports)
    calls = [node for node in ast.walk(function) if isinstance(node, ast.Call) and ast.unparse(node.func) == "train"]
    assert len(calls) == 1
    call = calls[0]
    assert ast.unparse(call.args[0]) == "f'{REPO}/{RECIPE}'"
    keywords = {keyword.arg: ast.unparse(keyword.value) for keyword in call.keywords}
    assert keywords.pop("accelerate_config") == "f'{REPO}/{ACCELERATE_CONFIG}'"
    assert set(keywords) <= set(recipe_field_owners()), "train() overrides must be recipe keys"
    assert f"{function.name}.distributed()" in ast.unparse(tree)
