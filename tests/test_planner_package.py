"""The planner package reads in one direction: each module imports only the modules below it, and only their
public names (src/sft_recipes/planner/__init__.py lists the order)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "src" / "sft_recipes" / "planner"
# Top to bottom: a module may import the ones after it, never one before it (nor itself).
ORDER = ["dry_run", "report", "vision", "layouts", "communication", "memory", "setup", "model_math"]


def planner_imports(path: Path) -> list[tuple[str, str | None]]:
    """(planner module, name imported from it or None for `import ...`) for every import in ``path``, the ones
    inside functions and `if TYPE_CHECKING:` included; a relative import counts as the module it names."""
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # `from .memory import x` / `from . import memory` inside the package
                module = f"sft_recipes.planner.{module}" if module else "sft_recipes.planner"
            if module == "sft_recipes.planner":  # `from sft_recipes.planner import memory`
                found += [(alias.name, None) for alias in node.names]
            elif module.startswith("sft_recipes.planner."):
                found += [(module.split(".")[2], alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name.split(".")[2], None) for alias in node.names
                      if alias.name.startswith("sft_recipes.planner.")]
    return found


def test_every_planner_module_has_its_place_in_the_order():
    assert sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__") == sorted(ORDER)
    assert planner_imports(PACKAGE / "__init__.py") == []  # importing model_math does not load the dry run


def violations(module: str, path: Path) -> list[str]:
    """What ``module`` (at ``path``) imports against the order: a module at or above it, or a private name."""
    found = []
    for imported, name in planner_imports(path):
        if ORDER.index(imported) <= ORDER.index(module):
            found.append(f"{module} imports {imported}")
        if name and name.startswith("_"):
            found.append(f"{module} imports {imported}.{name}")
    return found


def test_planner_modules_import_only_downward_and_only_public_names():
    assert [v for module in ORDER for v in violations(module, PACKAGE / f"{module}.py")] == []


def test_no_caller_imports_a_private_planner_name():
    private = [f"{path.relative_to(REPO_ROOT)}: {imported}.{name}"
               for folder in ("src", "scripts", "tests", "benchmarks", "notebooks")
               for path in (REPO_ROOT / folder).rglob("*.py") if PACKAGE not in path.parents
               for imported, name in planner_imports(path) if name and name.startswith("_")]
    assert private == []


def test_the_check_reports_a_cycle_and_a_private_name(tmp_path):
    # what the old plan.py / communication.py pair did: a lazy import back up, of a private helper
    module = tmp_path / "memory.py"
    module.write_text("from .setup import TrainingSetup\n\n\ndef f():\n"
                      "    from sft_recipes.planner.communication import _helper\n"
                      "    import sft_recipes.planner.memory\n")
    assert violations("memory", module) == ["memory imports communication", "memory imports communication._helper",
                                            "memory imports memory"]
