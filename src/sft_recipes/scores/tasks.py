"""Which benchmark tasks a recipe (or scripts/evaluate.py) asks for, read and checked before anything trains.

A task is named three ways: a task shipped in `evals/tasks/` (`alpaca_answers`, `gsm8k_local`), a local
lm-eval task file (`path/to/task.yaml`: `dataset_path: json` + `dataset_kwargs.data_files`), or a task of
lm-eval's registry (`gsm8k`, `ifeval`; their data comes from the Hugging Face Hub). Each may carry its own
`limit`, `num_fewshot` and `metric` (`exact_match,flexible-extract`: metric, then lm-eval's filter name).

Only lm-eval's YAML loader and metric registry are imported here, and only when a recipe names tasks: a run
without `eval_tasks` never imports lm_eval, and none of this loads a model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from sft_recipes.scores import import_lm_eval

REPO_ROOT = Path(__file__).resolve().parents[3]
SHIPPED_TASKS_DIR = REPO_ROOT / "evals" / "tasks"
NO_FILTER = "none"  # lm-eval's filter name for a metric without a filter_list
EXAMPLE = "eval_tasks: [alpaca_answers, {task: gsm8k_local, limit: 20}]"
_REGISTRY_KEY = re.compile(r"^(task|group|tag):\s*(\S.*)$", re.M)


@dataclass(frozen=True)
class EvalTask:
    """One task as asked for: `name` as lm-eval reports it, `config` (a local task's parsed YAML, its data
    paths absolute) or None for a registry task, the settings, and the metric the comparison reads."""

    name: str
    config: dict[str, Any] | None
    limit: int | None
    num_fewshot: int | None
    metric: str | None  # "metric,filter"; None: the task's first metric under its first filter

    @property
    def source(self) -> str:
        return "registry" if self.config is None else "local"

    def fingerprint(self) -> str:
        """What decides this task's score besides the model: its config, its data files' bytes, the settings and
        lm-eval's version (a cache key part)."""
        lm_eval = import_lm_eval()
        digest = hashlib.sha256(json.dumps([self.name, self.config, self.limit, self.num_fewshot,
                                            lm_eval.__version__], sort_keys=True,
                                           default=_named).encode())
        for path in data_files(self.config or {}):
            digest.update(Path(path).read_bytes())
        return digest.hexdigest()


def _named(value: Any) -> str:
    """A `!function` in a task config by its qualified name (its repr holds a memory address)."""
    return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', repr(value))}"


def data_files(config: dict[str, Any]) -> list[str]:
    files = (config.get("dataset_kwargs") or {}).get("data_files") or []
    if isinstance(files, dict):
        files = [f for value in files.values() for f in (value if isinstance(value, list) else [value])]
    return [files] if isinstance(files, str) else list(files)


@cache
def registry_names() -> frozenset[str]:
    """Every task, group and tag name lm-eval ships (its task YAML files read as text: ~1 s, where its
    TaskManager's full index takes ~20 s)."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None:
        return frozenset()
    root = Path(next(iter(spec.submodule_search_locations))) / "tasks"
    names = set()
    for path in root.rglob("*.yaml"):
        for match in _REGISTRY_KEY.finditer(path.read_text(errors="ignore")):
            names.add(match.group(2).strip().strip("'\""))
    return frozenset(names)


def shipped_task_file(name: str) -> Path | None:
    path = SHIPPED_TASKS_DIR / f"{name}.yaml"
    return path if path.is_file() else None


def read_task_file(path: Path) -> dict[str, Any]:
    """A local task YAML as lm-eval reads it (its `!function` and `include:` resolved), with relative data files
    made absolute: beside the YAML if there, else from the repository root (the shipped tasks' convention).
    ValueError names the file and what is wrong."""
    import_lm_eval()
    from lm_eval.tasks._yaml_loader import load_yaml  # what lm-eval's TaskManager reads task files with

    try:
        config = load_yaml(path)
    except Exception as err:  # yaml.YAMLError, a missing include, a !function that does not import
        raise ValueError(f"task file {path} does not parse ({type(err).__name__}: {str(err).splitlines()[0]})") \
            from None
    if not isinstance(config, dict) or not config.get("task"):
        raise ValueError(f"task file {path} has no `task:` name (an lm-eval task YAML names its task)")
    kwargs = config.get("dataset_kwargs") or {}
    if config.get("dataset_path") == "json" and "data_files" in kwargs:
        def absolute(file: str) -> str:
            for base in (path.parent, REPO_ROOT):
                if (base / file).is_file():
                    return str((base / file).resolve())
            raise ValueError(f"task file {path}: data file {file} is missing (looked beside the task file and in "
                             f"{REPO_ROOT})")

        files = kwargs["data_files"]
        if isinstance(files, dict):
            files = {split: [absolute(f) for f in v] if isinstance(v, list) else absolute(v)
                     for split, v in files.items()}
        else:
            files = [absolute(f) for f in files] if isinstance(files, list) else absolute(files)
        config = {**config, "dataset_kwargs": {**kwargs, "data_files": files}}
    return config


def metric_keys(config: dict[str, Any]) -> list[str]:
    """"metric,filter" for every metric under every filter of a task config, in lm-eval's order."""
    metrics = [entry["metric"] for entry in config.get("metric_list") or [] if isinstance(entry, dict)]
    filters = [entry["name"] for entry in config.get("filter_list") or [] if isinstance(entry, dict)] or [NO_FILTER]
    return [f"{metric},{flt}" for flt in filters for metric in metrics]


def unknown_metrics(config: dict[str, Any]) -> list[str]:
    """Metrics a local task lists that lm-eval does not have (it would look them up on the Hub, then fail).
    A task with its own `process_results` returns whatever it computes: not checked."""
    if "process_results" in config:
        return []
    import_lm_eval()
    import lm_eval.api.metrics  # noqa: F401  (importing it registers every built-in metric)
    from lm_eval.api.registry import metric_registry

    return [entry["metric"] for entry in config.get("metric_list") or []
            if isinstance(entry, dict) and isinstance(entry.get("metric"), str) and entry["metric"] not in metric_registry]


def parse_task(entry: Any, default_limit: int | None, default_fewshot: int | None) -> EvalTask:
    """One `eval_tasks` entry (a name or path, or a mapping with `task` and optional limit/num_fewshot/metric)
    -> EvalTask. ValueError says what is wrong and what to write instead."""
    settings: dict[str, Any] = {}
    if isinstance(entry, dict):
        unknown = set(entry) - {"task", "limit", "num_fewshot", "metric"}
        if unknown or not isinstance(entry.get("task"), str):
            raise ValueError(f"eval_tasks entry {entry!r}: a mapping takes `task` (a name or task file) and "
                             f"optionally limit, num_fewshot, metric (e.g. {EXAMPLE})")
        settings, entry = entry, entry["task"]
    if not isinstance(entry, str) or not entry:
        raise ValueError(f"eval_tasks entry {entry!r} is not a task name, a task file or a mapping ({EXAMPLE})")
    limit = settings.get("limit", default_limit)
    fewshot = settings.get("num_fewshot", default_fewshot)
    for key, value in (("limit", limit), ("num_fewshot", fewshot)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0
                                  or (key == "limit" and value == 0)):
            raise ValueError(f"eval_tasks entry {entry!r}: {key} must be a whole number "
                             f"({'at least 1' if key == 'limit' else '0 or more'}) or null, got {value!r}")
    path = Path(entry) if entry.endswith((".yaml", ".yml")) else shipped_task_file(entry)
    if (path.stem if path is not None else entry).startswith("ifeval"):  # before its file imports the checkers
        refuse_ifeval_without_its_data()
    if path is not None:
        if not path.is_file():
            raise ValueError(f"eval_tasks: task file {entry} does not exist (give a path to an lm-eval task YAML, or "
                             f"a task name: shipped ones are {', '.join(shipped_task_names())})")
        config = read_task_file(path)
        bad = unknown_metrics(config)
        if bad:
            raise ValueError(f"task file {path}: metric {', '.join(map(repr, bad))} does not exist in lm-eval "
                             f"(its metrics include acc, acc_norm, exact_match, perplexity, f1, bleu)")
        task = EvalTask(config["task"], config, limit, fewshot, settings.get("metric"))
        available = metric_keys(config)
    elif entry in registry_names():
        task, available = EvalTask(entry, None, limit, fewshot, settings.get("metric")), None
    else:
        import difflib

        close = difflib.get_close_matches(entry, [*shipped_task_names(), *registry_names()], n=3)
        raise ValueError(f"eval_tasks: unknown task {entry!r} -- not a task shipped in evals/tasks/ "
                         f"({', '.join(shipped_task_names())}), not one of lm-eval's tasks"
                         + (f" (closest: {', '.join(close)})" if close else "")
                         + ", and not a .yaml task file")
    if task.metric is not None:
        if "," not in task.metric:
            task = EvalTask(task.name, task.config, task.limit, task.num_fewshot, f"{task.metric},{NO_FILTER}")
        if available is not None and task.metric not in available:
            raise ValueError(f"eval_tasks: task {task.name!r} reports no metric {task.metric!r}: it reports "
                             f"{', '.join(available)} (metric,filter)")
    return task


def refuse_ifeval_without_its_data() -> None:
    """IFEval's checkers import packages lm-eval does not install and count sentences with nltk's punkt_tab data,
    which lm-eval downloads at import (offline: the download fails, and the evaluation stops with LookupError at
    its first sentence-count check, after training). Refused now instead."""
    missing = [name for name in ("immutabledict", "langdetect", "nltk") if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"eval_tasks: ifeval needs {', '.join(missing)}: .venv/bin/pip install "
                         "'lm-eval[ifeval]==0.4.13' (docs/evaluation.md)")
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab")
    except LookupError:
        raise ValueError("eval_tasks: ifeval needs nltk's punkt_tab data, which is not on this machine (lm-eval "
                         "would try to download it and fail offline): run .venv/bin/python -m nltk.downloader "
                         "punkt_tab where there is internet and copy ~/nltk_data here (or set NLTK_DATA)") from None


def shipped_task_names() -> list[str]:
    return sorted(path.stem for path in SHIPPED_TASKS_DIR.glob("*.yaml"))


def parse_tasks(entries: list[Any] | None, limit: int | None = None, num_fewshot: int | None = None) -> list[EvalTask]:
    if entries and importlib.util.find_spec("lm_eval") is None:
        raise ValueError("eval_tasks needs EleutherAI's lm-evaluation-harness: .venv/bin/pip install lm-eval==0.4.13 "
                         "(make eval and make test install it)")
    tasks = [parse_task(entry, limit, num_fewshot) for entry in entries or []]
    names = [task.name for task in tasks]
    if len(set(names)) != len(names):
        raise ValueError(f"eval_tasks names a task twice ({', '.join(sorted({n for n in names if names.count(n) > 1}))})"
                         ": each task is scored once per model")
    return tasks


def max_regression_for(max_regression: float | dict[str, float] | None, task: str) -> float | None:
    """The largest drop of `task`'s score from base to tuned the gate lets pass (None: no gate for it)."""
    if isinstance(max_regression, dict):
        return max_regression.get(task)
    return max_regression


def check_max_regression(max_regression: Any, tasks: list[EvalTask]) -> None:
    if max_regression is None:
        return
    if isinstance(max_regression, dict):
        unknown = set(max_regression) - {task.name for task in tasks}
        if unknown:
            raise ValueError(f"eval_max_regression names {', '.join(sorted(unknown))}, which eval_tasks does not "
                             f"score (its tasks: {', '.join(task.name for task in tasks) or 'none'})")
        values = list(max_regression.values())
    else:
        values = [max_regression]
    if not tasks:
        raise ValueError("eval_max_regression is set but eval_tasks is empty: name the tasks to compare "
                         f"({EXAMPLE})")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"eval_max_regression must be a number (a score drop, e.g. 0.02) or a mapping task -> "
                             f"number, got {max_regression!r}")
