"""Databricks AI Runtime workload files (`databricks air run -f workloads/X.yaml`), checked offline.

    .venv/bin/python -m sft_recipes.workload check workloads/llama8b.yaml [--model-config CONFIG.json]

Every problem at once, one line each with its fix, exit 2; warnings do not fail the check. Two sets
of rules (see docs/ai-runtime.md):

1. The runtime's own structural rules for a run config, restated as facts (the code is under the
   Databricks License; none of it is copied) from the public Databricks CLI, github.com/databricks/cli:
   `experimental/air/cmd/runconfig.go`, `runconfig_load.go`, `compute.go` at commit 7bbe2852131b
   (2026-08-21), and their successors `cmd/air/runconfig.go` (commit 138f0785f193), `cmd/air/compute.go`
   (e7083e1e360f) and `cmd/air/runconfig_load.go` (924b7564af77), which add GPU_8xB300, compute.pool_id /
   priority_class, environment.unity_catalog_image, mlflow_artifact_location and the
   environment.version forms. Facts encoded:
   - unknown keys are refused at every level (the CLI decodes with known fields only);
   - required: experiment_name (1-100 characters of [A-Za-z0-9_-]: it becomes a Jobs task key),
     compute, command;
   - compute.accelerator_type is one of GPU_1xA10, GPU_1xH100, GPU_8xH100, GPU_8xB300 (case-sensitive);
     compute.num_accelerators is a positive multiple of its GPUs per node (1, 1, 8, 8): whole nodes;
     pool_id 1-255 characters; priority_class BEST_EFFORT / NORMAL / CRITICAL (any case), only with pool_id;
   - environment.dependencies is a list (a bare requirements-file path is refused); environment.version
     is an integer, optionally prefixed `databricks_ai_v` (any case), which needs version 5 or higher;
     unity_catalog_image is `<catalog>.<schema>.<image>:<tag>` and excludes dependencies and version;
   - command: not blank, at most 1000 lines;
   - secrets are `scope/key` (two non-empty parts); no name in both env_variables and secrets;
   - code_source: `root_path` (not blank), optional `remote_volume` (/Volumes/...), `include_paths`
     (a non-empty list of relative paths without `..`), `git` (exactly one of branch/commit, branch of
     [\\w./-], `remote` no longer supported). The current form, which seed 001 and the bundle's
     ai_runtime_task use, puts these directly under code_source; the CLI snapshots above still
     decode the older `type: snapshot` + `snapshot:` nesting, which is accepted too;
   - max_retries >= 0, 3 when unset; timeout_minutes >= 1; idempotency_token 1-64 characters;
     mlflow_run_name like experiment_name; mlflow_experiment_directory under /Workspace;
     mlflow_artifact_location a dbfs:/ URI or /Volumes/ path; permissions: exactly one principal and a
     level; usage_policy_name (1-127 characters) excludes usage_policy_id (a UUID).
   NOT reproduced: what `databricks air run --dry-run` asks the server (POST
   /api/2.0/ai-training/config:validate: workspace access to the GPU type, secret scopes, volumes,
   the image), and the `databricks` CLI cannot be installed here to compare against.

2. Ours, across files: the command must run scripts/launch_multinode.sh (or `accelerate launch ...
   scripts/sft.py`) with an accelerate config and a recipe that exist; the GPUs requested equal nodes x
   processes per node of that config; the recipe, with `parameters:` and the command's `--key value`
   applied, loads, and its `--dry-run` plan fits the GPU type (else: the shortfall in GiB and a
   variant from the recipe header that fits); a gated model needs an HF_TOKEN secret; output_dir off
   /Volumes/ is a warning (the container's disk is gone after the run), and so are the shipped workloads'
   placeholders left in place (`my_scope/...` secrets, the /Volumes/main/default/ volume); `parameters:` keys must be
   recipe keys; dependencies must not contradict requirements.txt; experiment_name must be the
   recipe's mlflow_experiment_name when it logs to MLflow; retries (max_retries, 3 when unset) need
   `resume_from_checkpoint: auto`, or every retry starts over.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import json
import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from sft_recipes.command_line import OneLineParser
from sft_recipes.config import PARAMETERS_ENV, without_overridden_batch_keys
from sft_recipes.errors import RecipeError
from sft_recipes.launch import AccelerateConfig, read_accelerate_config
from sft_recipes.loading import ConfigNotInTheCache

# ---- the runtime's rules (facts from the Databricks CLI, see the module docstring) ----------------

GPUS_PER_NODE = {"GPU_1xA10": 1, "GPU_1xH100": 1, "GPU_8xH100": 8, "GPU_8xB300": 8}
# The planner's name for each accelerator type's GPU (planner.model_math.GPUS); A10 is not planned.
PLANNED_GPU = {"GPU_1xH100": "H100", "GPU_8xH100": "H100", "GPU_8xB300": "B300"}
DEFAULT_MAX_RETRIES = 3
MAX_COMMAND_LINES = 1000
PRIORITY_CLASSES = ("BEST_EFFORT", "NORMAL", "CRITICAL")

TOP_LEVEL_KEYS = ("experiment_name", "compute", "environment", "command", "env_variables", "secrets", "code_source",
                  "max_retries", "timeout_minutes", "idempotency_token", "parameters", "mlflow_run_name",
                  "mlflow_experiment_directory", "mlflow_artifact_location", "permissions", "usage_policy_name",
                  "usage_policy_id")
REQUIRED_KEYS = ("experiment_name", "compute", "command")
COMPUTE_KEYS = ("num_accelerators", "accelerator_type", "pool_id", "priority_class")
ENVIRONMENT_KEYS = ("dependencies", "version", "unity_catalog_image")
SNAPSHOT_KEYS = ("root_path", "remote_volume", "git", "include_paths")
GIT_KEYS = ("branch", "commit", "remote")
PERMISSION_KEYS = ("user_name", "group_name", "service_principal_name", "level")

_TASK_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_GIT_REF = re.compile(r"^[\w./-]+$")
_UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
_UC_IMAGE = re.compile(r"^[^.:\s]+\.[^.:\s]+\.[^.:\s]+:[^:\s]+$")
_VERSION = re.compile(r"^(databricks_ai_v)?([0-9]+)$")

# Hub repositories that are gated (a token of an account that accepted the license downloads them).
GATED_MODEL_PREFIXES = ("meta-llama/", "google/gemma")
# The shipped workloads' stand-ins for what only their user knows: a secret scope, and a Unity Catalog volume
# (catalog `main`, schema `default`). They pass every rule, so the check warns that they are to be replaced.
PLACEHOLDER_SECRET_SCOPE = "my_scope/"
PLACEHOLDER_VOLUME = "/Volumes/main/default/"
LAUNCHER = "scripts/launch_multinode.sh"


@dataclass(frozen=True)
class Problem:
    """One line: what is wrong, then how to fix it. A warning does not fail the check."""

    message: str
    warning: bool = False


def _unknown(section: str, given: Mapping, allowed: tuple[str, ...]) -> list[str]:
    problems = []
    for key in given:
        if key in allowed:
            continue
        close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
        fix = f"did you mean '{close[0]}'?" if close else f"the keys there are {', '.join(allowed)}"
        problems.append(f"{section}: unknown key '{key}' (the runtime refuses the file): {fix}")
    return problems


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _task_key_problems(name: str, value) -> list[str]:
    if not isinstance(value, str) or not value.strip():
        return [f"{name} is empty: give it a name of letters, digits, '-' and '_'"]
    if len(value) > 100:
        return [f"{name} has {len(value)} characters: the runtime allows 100 (a Jobs task key); shorten it"]
    if not _TASK_KEY.match(value):
        return [f"{name} {value!r} has characters other than letters, digits, '-' and '_': replace them"]
    return []


def _compute_problems(compute) -> list[str]:
    if not isinstance(compute, Mapping):
        return ["compute must be a mapping with num_accelerators and accelerator_type"]
    problems = _unknown("compute", compute, COMPUTE_KEYS)
    kind, count = compute.get("accelerator_type"), compute.get("num_accelerators")
    if kind not in GPUS_PER_NODE:
        problems.append(f"compute.accelerator_type {kind!r} is not a type the runtime knows: use one of "
                        f"{', '.join(GPUS_PER_NODE)} (exact case)")
    if not _is_int(count) or count <= 0:
        problems.append(f"compute.num_accelerators {count!r} must be a positive whole number of GPUs: "
                        "set it to nodes x GPUs per node")
    elif kind in GPUS_PER_NODE and count % GPUS_PER_NODE[kind]:
        per_node = GPUS_PER_NODE[kind]
        problems.append(f"compute.num_accelerators {count} is not a multiple of {per_node} ({kind} allocates whole "
                        f"nodes of {per_node}): use {max(per_node, count // per_node * per_node)} or "
                        f"{(count // per_node + 1) * per_node}")
    pool = compute.get("pool_id")
    if pool is not None and not (isinstance(pool, str) and 0 < len(pool.strip()) <= 255):
        problems.append("compute.pool_id must be 1-255 characters: give the pool's id (`databricks air pools list`)")
    priority = compute.get("priority_class")
    if priority is not None:
        if str(priority).strip().upper() not in PRIORITY_CLASSES:
            problems.append(f"compute.priority_class {priority!r}: use one of {', '.join(PRIORITY_CLASSES)}")
        if pool is None:
            problems.append("compute.priority_class needs compute.pool_id (priority ranks work within a pool): "
                            "add pool_id or remove priority_class")
    return problems


def _environment_problems(environment) -> list[str]:
    if not isinstance(environment, Mapping):
        return ["environment must be a mapping (dependencies, version or unity_catalog_image)"]
    problems = _unknown("environment", environment, ENVIRONMENT_KEYS)
    if "dependencies" in environment and not isinstance(environment["dependencies"], list):
        problems.append("environment.dependencies must be a list of packages (a bare requirements file path is "
                        "refused): write one `- package==version` per line")
    image = environment.get("unity_catalog_image")
    if image is not None:
        if not (isinstance(image, str) and _UC_IMAGE.match(image)):
            problems.append(f"environment.unity_catalog_image {image!r} must be <catalog>.<schema>.<image>:<tag>")
        clashing = [key for key in ("dependencies", "version") if key in environment]
        if clashing:
            problems.append(f"environment.unity_catalog_image excludes {' and '.join(clashing)} (the image pins the "
                            f"whole runtime): remove {' and '.join(clashing)} or the image")
        return problems
    if "version" in environment:
        version = environment["version"]
        match = _VERSION.match(str(version).lower()) if isinstance(version, (str, int)) and version is not True \
            and version is not False else None
        if match is None:
            problems.append(f"environment.version {version!r} must be an integer, optionally prefixed databricks_ai_v "
                            "(e.g. 4 or databricks_ai_v6)")
        elif match.group(1) and int(match.group(2)) < 5:
            problems.append(f"environment.version {version!r}: the databricks_ai_v prefix needs version 5 or higher; "
                            f"write {match.group(2)} or databricks_ai_v5+")
    return problems


def _git_problems(git, section: str) -> list[str]:
    if not isinstance(git, Mapping):
        return [f"{section} must be a mapping with branch or commit"]
    problems = _unknown(section, git, GIT_KEYS)
    branch, commit = git.get("branch"), git.get("commit")
    if branch is not None and not _GIT_REF.match(str(branch)):
        problems.append(f"{section}.branch {branch!r} has characters outside letters, digits, '.', '/', '-', '_'")
    remote = git.get("remote")
    if remote not in (None, False, ""):
        problems.append(f"{section}.remote is no longer supported (the snapshot archives your local copy): remove it "
                        "and pin a revision with commit")
    if (branch is None) == (commit is None):
        problems.append(f"{section} needs exactly one of branch or commit")
    return problems


def _snapshot_problems(snapshot: Mapping, section: str) -> list[str]:
    problems = _unknown(section, snapshot, SNAPSHOT_KEYS)
    if not str(snapshot.get("root_path") or "").strip():
        problems.append(f"{section}.root_path is missing: the directory to upload, relative to this file (e.g. '..')")
    volume = snapshot.get("remote_volume")
    if volume is not None and not str(volume).startswith("/Volumes/"):
        problems.append(f"{section}.remote_volume {volume!r} must start with /Volumes/")
    includes = snapshot.get("include_paths")
    if includes is not None:
        if not isinstance(includes, list) or not includes:
            problems.append(f"{section}.include_paths must be a non-empty list: list paths, or remove it for everything")
        else:
            for entry in includes:
                entry = str(entry).strip()
                if not entry or entry.startswith("/") or ".." in entry.split("/"):
                    problems.append(f"{section}.include_paths entry {entry!r} must be a relative path inside root_path "
                                    "(no leading /, no ..)")
    if "git" in snapshot:
        problems += _git_problems(snapshot["git"], f"{section}.git")
    return problems


def _code_source_problems(code_source) -> list[str]:
    if not isinstance(code_source, Mapping):
        return ["code_source must be a mapping: `code_source: {root_path: ..}`"]
    if "type" in code_source or "snapshot" in code_source:  # the older nested form
        problems = _unknown("code_source", code_source, ("type", "snapshot"))
        if code_source.get("type") != "snapshot":
            problems.append(f"code_source.type {code_source.get('type')!r} must be 'snapshot' (or use the flat form: "
                            "code_source.root_path)")
        if not isinstance(code_source.get("snapshot"), Mapping):
            return problems + ["code_source.type 'snapshot' needs a code_source.snapshot mapping with root_path"]
        return problems + _snapshot_problems(code_source["snapshot"], "code_source.snapshot")
    return _snapshot_problems(code_source, "code_source")


def _permission_problems(permissions) -> list[str]:
    if not isinstance(permissions, list):
        return ["permissions must be a list of {user_name|group_name|service_principal_name, level} grants"]
    problems = []
    for i, grant in enumerate(permissions):
        section = f"permissions[{i}]"
        if not isinstance(grant, Mapping):
            problems.append(f"{section} must be a mapping with one principal and a level")
            continue
        problems += _unknown(section, grant, PERMISSION_KEYS)
        principals = [key for key in PERMISSION_KEYS[:3] if key in grant]
        if len(principals) != 1:
            problems.append(f"{section} names {len(principals)} principals: give exactly one of user_name, "
                            "group_name, service_principal_name")
        elif not str(grant[principals[0]] or "").strip():
            problems.append(f"{section}.{principals[0]} is empty")
        if not str(grant.get("level") or "").strip():
            problems.append(f"{section}.level is missing: e.g. CAN_VIEW or CAN_MANAGE")
    return problems


def runtime_problems(workload: Mapping) -> dict[str, list[str]]:
    """The runtime's own structural rules (module docstring, part 1), every violation at once, by section
    (so that the cross-file rules run wherever the sections they read are sound)."""
    sections: dict[str, list[str]] = {}
    problems = _unknown("workload", workload, TOP_LEVEL_KEYS)
    problems += [f"{key} is required: add it (see workloads/llama8b.yaml)" for key in REQUIRED_KEYS if key not in workload]
    sections["workload"] = problems
    if "experiment_name" in workload:
        sections["experiment_name"] = _task_key_problems("experiment_name", workload["experiment_name"])
    if "compute" in workload:
        sections["compute"] = _compute_problems(workload["compute"])
    if "environment" in workload:
        sections["environment"] = _environment_problems(workload["environment"])
    if "command" in workload:
        command, problems = workload["command"], []
        if not isinstance(command, str) or not command.strip():
            problems.append("command is empty: run scripts/launch_multinode.sh CONFIG RECIPE on every node")
        elif command.count("\n") + 1 > MAX_COMMAND_LINES:
            problems.append(f"command has {command.count(chr(10)) + 1} lines (the runtime allows {MAX_COMMAND_LINES}): "
                            "move the logic into a script under code_source")
        sections["command"] = problems
    mappings = {}
    for key in ("env_variables", "secrets", "parameters"):
        value = workload.get(key)
        sections[key] = [f"{key} must be a mapping of NAME: value"] if value is not None and not isinstance(value, Mapping) \
            else []
        mappings[key] = value if isinstance(value, Mapping) else {}
    for name, reference in mappings["secrets"].items():
        parts = str(reference).split("/")
        if len(parts) != 2 or not all(parts):
            sections["secrets"].append(f"secrets.{name} {reference!r} must be 'scope/key' (e.g. my_scope/hf_token)")
    for name in sorted(set(mappings["env_variables"]) & set(mappings["secrets"])):
        sections["env_variables"].append(f"{name} is in both env_variables and secrets: remove it from env_variables")
    if "code_source" in workload:
        sections["code_source"] = _code_source_problems(workload["code_source"])
    problems = []
    for key, least in (("max_retries", 0), ("timeout_minutes", 1)):
        value = workload.get(key)
        if value is not None and (not _is_int(value) or value < least):
            problems.append(f"{key} {value!r} must be a whole number >= {least}")
    token = workload.get("idempotency_token")
    if token is not None and not (isinstance(token, str) and 0 < len(token.strip()) <= 64):
        problems.append("idempotency_token must be 1-64 characters")
    if "mlflow_run_name" in workload:
        problems += _task_key_problems("mlflow_run_name", workload["mlflow_run_name"])
    directory = workload.get("mlflow_experiment_directory")
    if directory is not None and not str(directory).strip().startswith("/Workspace"):
        problems.append(f"mlflow_experiment_directory {directory!r} must start with /Workspace")
    artifacts = workload.get("mlflow_artifact_location")
    if artifacts is not None and not str(artifacts).strip().startswith(("dbfs:/", "/Volumes/")):
        problems.append(f"mlflow_artifact_location {artifacts!r} must be a dbfs:/ URI or a /Volumes/ path")
    if "permissions" in workload:
        problems += _permission_problems(workload["permissions"])
    policy_name, policy_id = workload.get("usage_policy_name"), workload.get("usage_policy_id")
    if policy_name is not None and policy_id is not None:
        problems.append("usage_policy_name and usage_policy_id exclude each other: keep one")
    if policy_name is not None and not (isinstance(policy_name, str) and 0 < len(policy_name.strip()) <= 127):
        problems.append("usage_policy_name must be 1-127 characters")
    if policy_id is not None and not _UUID.match(str(policy_id).strip()):
        problems.append(f"usage_policy_id {policy_id!r} must be a UUID; to name the policy use usage_policy_name")
    sections["run options"] = problems
    return sections


# ---- ours: the workload against the files it launches ---------------------------------------------

@dataclass(frozen=True)
class Launch:
    """What a workload's command launches on each node."""

    config: str
    recipe: str
    overrides: dict  # the command's `--key value` after the recipe


_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def expand_command(command: str, env_variables: Mapping) -> str:
    """The command as the runtime's shell would read it, for the variables the workload decides itself:
    env_variables' values, else `${VAR:-default}`'s default; other variables stay as written."""
    def expand(match: re.Match) -> str:
        name = match.group(1) or match.group(3)
        if name in env_variables:
            return str(env_variables[name])
        return match.group(2) if match.group(2) is not None else match.group(0)

    return _VARIABLE.sub(expand, command.replace("\\\n", " "))


def launched(command: str, env_variables: Mapping) -> Launch | None:
    """The accelerate config, recipe and `--key value` overrides the command launches, or None."""
    from sft_recipes.config import parse_cli_overrides

    for line in expand_command(command, env_variables).splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        for separator in (";", "&&", "||", "|"):
            if separator in words:
                words = words[:words.index(separator)]
        if any(word.endswith(LAUNCHER) for word in words):
            start = next(i for i, word in enumerate(words) if word.endswith(LAUNCHER))
            args = words[start + 1:]
            if len(args) >= 2:
                return Launch(args[0], args[1], parse_cli_overrides(args[2:]))
        if "scripts/sft.py" in words and "--config_file" in words:
            config = words[words.index("--config_file") + 1]
            args = words[words.index("scripts/sft.py") + 1:]
            if args:
                return Launch(config, args[0], parse_cli_overrides(args[1:]))
    return None


def header_variants(recipe_path: Path) -> list[str]:
    """The `--key value` variants of the launch commands in a recipe's leading comment block, in order."""
    variants = []
    for line in recipe_path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text.startswith("--") and "--config_file" not in text:
            variants.append(text.split("  #")[0].split(" (")[0].strip())
    return variants


@functools.lru_cache(maxsize=32)
def _plan(recipe: str, overrides_json: str, config_path: str, world_size: int):
    """The --dry-run plan (cached: broken copies of one workload share it)."""
    from sft_recipes.config import load_recipe
    from sft_recipes.planner.report import plan_recipe

    config = read_accelerate_config(config_path)
    return plan_recipe(load_recipe(recipe, json.loads(overrides_json), planning=True), config, world_size)


def _fit_problems(recipe_path: Path, overrides: dict, config: AccelerateConfig, compute: Mapping,
                  model_config: str | None) -> list[Problem]:
    gpu = PLANNED_GPU.get(compute.get("accelerator_type"))
    world_size = compute.get("num_accelerators")
    if gpu is None or not _is_int(world_size):
        return []
    planned = {**overrides, **({"model_name_or_path": model_config} if model_config else {})}

    def plan(extra: dict):
        return _plan(str(recipe_path), json.dumps({**planned, **extra}, sort_keys=True), str(config.path), world_size)

    try:
        base = plan({})
    except ConfigNotInTheCache as err:
        config_file = (f"`--model-config {err.shipped.as_posix()}` (shipped with this clone)" if err.shipped else
                       "`--model-config CONFIG.json` (the model's config.json, or its directory)")
        return [Problem(f"the memory plan was not checked: {err.name} is not in the Hugging Face cache and the "
                        f"planner never downloads: pass {config_file}, or run `.venv/bin/hf download {err.name} "
                        "config.json` first", True)]
    except RecipeError as err:
        return [Problem(f"the recipe's --dry-run plan fails: {err}")]
    except ValueError as err:
        return [Problem(f"the recipe's --dry-run plan fails: {err}: fix the sizes in parameters or the command")]
    headroom = base.headroom_gib[gpu]
    if headroom >= 0:
        return []
    from sft_recipes.config import parse_cli_overrides

    need = base.memory.total
    fix = "; no variant in the recipe header fits either: lower max_length or per_device_train_batch_size"
    for variant in header_variants(recipe_path):
        try:
            fitted = plan(parse_cli_overrides(shlex.split(variant)))
        except (RecipeError, ValueError):
            continue
        if fitted.headroom_gib[gpu] >= 0:
            fix = (f"; the recipe header's variant `{variant}` fits ({fitted.memory.total:.1f} GiB): add it to "
                   "parameters")
            break
    return [Problem(f"the plan needs {need:.1f} GiB per GPU and {compute['accelerator_type']}'s {gpu} has "
                    f"{need + headroom:.1f}: {-headroom:.1f} GiB short{fix}")]


def _pins(requirements: Path) -> dict[str, str]:
    from packaging.utils import canonicalize_name

    pins = {}
    for line in requirements.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[canonicalize_name(name.strip())] = version.strip()
    return pins


def _dependency_problems(dependencies: list, requirements: Path) -> list[str]:
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    if not requirements.is_file():
        return []
    pins, problems = _pins(requirements), []
    for entry in dependencies:
        text = str(entry).strip()
        if text.startswith("-") or not text:
            continue
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            problems.append(f"environment.dependencies entry {text!r} is not a pip requirement: write name==version")
            continue
        pinned = pins.get(canonicalize_name(requirement.name))
        if pinned and requirement.specifier and not requirement.specifier.contains(pinned, prereleases=True):
            problems.append(f"environment.dependencies {text!r} contradicts requirements.txt ({requirement.name}=="
                            f"{pinned}, the tested set): use {requirement.name}=={pinned}")
    return problems


@contextlib.contextmanager
def _runtime_environment(env_variables: Mapping):
    """os.environ with the workload's env_variables set (and HYPERPARAMETERS_PATH unset: `parameters:` is applied
    explicitly), restored afterwards."""
    saved = dict(os.environ)
    os.environ.pop(PARAMETERS_ENV, None)
    os.environ.update({str(name): str(value) for name, value in env_variables.items()})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def cross_file_problems(workload: Mapping, workload_path: Path, model_config: str | None = None,
                        sound: Mapping[str, bool] | None = None) -> list[Problem]:
    """Ours (module docstring, part 2): the workload against the config, recipe and pins it launches.

    `sound`: which sections passed the runtime's rules (default: all); a rule that reads a broken section is
    skipped, the section's own line already says what to fix."""
    from sft_recipes.config import SECRET_KEYS, load_recipe, recipe_field_owners

    sound = {key: True for key in ("compute", "environment", "launch")} | dict(sound or {})
    env_variables = workload.get("env_variables") or {}
    secrets = workload.get("secrets") or {}
    parameters = workload.get("parameters") or {}
    compute = workload.get("compute") if sound["compute"] else {}
    code_source = workload.get("code_source") or {}
    snapshot = code_source.get("snapshot", code_source) if isinstance(code_source, Mapping) else {}
    root = (workload_path.parent / str(snapshot.get("root_path") or ".")).resolve()
    problems: list[Problem] = []

    for name, reference in secrets.items():
        if str(reference).startswith(PLACEHOLDER_SECRET_SCOPE):
            problems.append(Problem(f"secrets.{name} {reference!r} is the example's placeholder: replace it with the "
                                    "scope/key of your Databricks secret (`databricks secrets list-scopes`)",
                                    warning=True))
    owners = recipe_field_owners()
    for key in parameters:
        if key in SECRET_KEYS:
            problems.append(Problem(f"parameters.{key} would write a secret into the run's arguments: remove it and "
                                    f"add `secrets: {{{SECRET_KEYS[key]}: scope/key}}`"))
        elif key not in owners:
            close = difflib.get_close_matches(str(key), owners, n=1, cutoff=0.6)
            problems.append(Problem(f"parameters.{key} is not a recipe key"
                                    + (f": did you mean '{close[0]}'?" if close else ": remove it (see src/sft_recipes/config.py)")))

    dependencies = (workload.get("environment") or {}).get("dependencies")
    if isinstance(dependencies, list) and sound["environment"] and sound["launch"]:
        problems += [Problem(p) for p in _dependency_problems(dependencies, root / "requirements.txt")]
    if not sound["launch"]:
        return problems

    launch = launched(str(workload.get("command") or ""), env_variables)
    if launch is None:
        problems.append(Problem(f"command does not run {LAUNCHER} CONFIG RECIPE (nor accelerate launch --config_file "
                                "CONFIG scripts/sft.py RECIPE), so nothing else can be checked: launch through it"))
        return problems
    config_path, recipe_path = root / launch.config, root / launch.recipe
    missing = [f"{name} {path.relative_to(root) if path.is_relative_to(root) else path}"
               for name, path in (("accelerate config", config_path), ("recipe", recipe_path)) if not path.is_file()]
    if missing:
        problems.append(Problem(f"the command launches {' and '.join(missing)}, which code_source.root_path {root} "
                                "does not hold: fix the path (relative to root_path)"))
        return problems
    config = read_accelerate_config(config_path)
    problems += [Problem(p) for p in config.problems()]
    count, kind = compute.get("num_accelerators"), compute.get("accelerator_type")
    if _is_int(count) and kind in GPUS_PER_NODE:
        nodes, per_node = count // GPUS_PER_NODE[kind] or 1, GPUS_PER_NODE[kind]
        if (count, per_node) != (config.num_processes, config.processes_per_node):
            problems.append(Problem(
                f"compute asks for {count} GPUs ({nodes} node(s) x {per_node} {kind}) but {launch.config} launches "
                f"{config.num_machines} machine(s) x {config.processes_per_node} processes: use the config for "
                f"{nodes} x {per_node} or set num_accelerators to {config.num_processes}"))

    # The run reads `parameters:` (HYPERPARAMETERS_PATH), then the command's overrides: a global batch in the later
    # replaces the batch keys of the earlier, as load_recipe does between sources.
    parameters_kept, command = without_overridden_batch_keys(parameters, launch.overrides)
    overrides = {key: value for key, value in {**parameters_kept, **command}.items()
                 if key in owners and key not in SECRET_KEYS}  # the others are reported above
    try:
        with _runtime_environment(env_variables):  # the recipe's ${VAR:-default} as the runtime expands them
            recipe = load_recipe(recipe_path, overrides, planning=True, overrides_source="workload", override_origins={
                key: f"{workload_path.name} {'command' if key in command else 'parameters:'}" for key in overrides})
    except RecipeError as err:
        problems.append(Problem(f"the recipe with parameters and the command's overrides does not load: {err}"))
        return problems
    values = recipe.values
    if _is_int(count):  # the run's first check: a global batch the GPUs cannot make, or a fixed accumulation beside it
        from sft_recipes.lint import LintContext, batch_the_world_cannot_produce

        if batch := batch_the_world_cannot_produce(recipe, LintContext(count, True)):
            problems.append(Problem(f"the recipe with parameters on {count} GPUs: {batch}"))

    model = str(values.get("model_name_or_path", ""))
    if model.startswith(GATED_MODEL_PREFIXES) and "HF_TOKEN" not in secrets:
        where = " (it is in env_variables, in plain text)" if "HF_TOKEN" in env_variables else ""
        problems.append(Problem(f"{model} is gated on the Hugging Face Hub and the workload has no HF_TOKEN secret{where}: "
                                "add `secrets: {HF_TOKEN: my_scope/hf_token}`"))
    output_dir = str(values.get("output_dir", ""))
    if output_dir.startswith(PLACEHOLDER_VOLUME):
        built = "output_dir" not in overrides and {"UC_CATALOG", "UC_SCHEMA"} <= set(env_variables)  # gpt-oss's
        fix = ("set env_variables UC_CATALOG, UC_SCHEMA and UC_VOLUME to a volume you can write" if built else
               "set parameters.output_dir to a volume you can write, /Volumes/<catalog>/<schema>/<volume>/...")
        problems.append(Problem(f"output_dir {output_dir!r} is the example's placeholder volume (catalog main, schema "
                                f"default): {fix}", warning=True))
    elif not output_dir.startswith("/Volumes/"):
        problems.append(Problem(f"output_dir {output_dir!r} is not on a /Volumes/ path: the container's disk is gone "
                                "after the run; set parameters.output_dir: /Volumes/<catalog>/<schema>/<volume>/...",
                                warning=True))
    report_to = values.get("report_to")
    logs_to_mlflow = "mlflow" in (report_to if isinstance(report_to, list) else [report_to])
    recipe_experiment = values.get("mlflow_experiment_name")
    experiment = workload.get("experiment_name")
    if (logs_to_mlflow and recipe_experiment and recipe_experiment != experiment
            and not _task_key_problems("experiment_name", experiment)):  # an invalid name has its own line
        problems.append(Problem(f"experiment_name {workload.get('experiment_name')!r} and the recipe's "
                                f"mlflow_experiment_name {recipe_experiment!r} disagree: the runtime's run and ours would "
                                "land in different experiments; set parameters.mlflow_experiment_name to experiment_name"))
    retries = workload.get("max_retries", DEFAULT_MAX_RETRIES)
    if _is_int(retries) and retries > 0 and values.get("resume_from_checkpoint") != "auto":
        unset = " (unset: the runtime's default 3)" if "max_retries" not in workload else ""
        problems.append(Problem(f"max_retries {retries}{unset} re-runs the command after a failure but the recipe's "
                                f"resume_from_checkpoint is {values.get('resume_from_checkpoint')!r}: every retry would "
                                "start over; set parameters.resume_from_checkpoint: auto (or max_retries: 0)"))
    with _runtime_environment(env_variables):
        problems += _fit_problems(recipe_path, overrides, config, compute, model_config)
    return problems


def check_workload(path: str | Path, model_config: str | None = None) -> list[Problem]:
    """Every problem of one workload file: the runtime's rules, then ours when the structure allows them."""
    path = Path(path)
    if not path.is_file():
        return [Problem(f"{path} not found: see workloads/")]
    try:
        workload = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        return [Problem(f"not valid YAML: {err}".replace("\n", " "))]
    if not isinstance(workload, Mapping):
        return [Problem("a workload is a YAML mapping (experiment_name, compute, command, ...): see workloads/")]
    sections = runtime_problems(workload)
    problems = [Problem(p) for section in sections.values() for p in section]
    # Ours read these sections: where one of them is broken, its own line says so and ours would only echo it.
    if sections.get("parameters"):
        return problems
    launch_sections = ("command", "code_source", "env_variables", "secrets")
    sound = {"compute": "compute" in workload and not sections.get("compute"),
             "environment": not sections.get("environment"),
             "launch": "command" in workload and not any(sections.get(key) for key in launch_sections)}
    return problems + cross_file_problems(workload, path, model_config, sound)


def format_problems(path: str | Path, problems: list[Problem]) -> list[str]:
    return [f"{'warning' if p.warning else 'error'}: {path}: {p.message}" for p in problems]


def dry_run_as_the_workload(path: str | Path, overrides: list[str]) -> tuple[str, str | None]:
    """`scripts/sft.py RECIPE --dry-run --workload PATH`: the same check (its lines on stderr, RecipeError on any
    error), then the dry run plans what the workload launches: its `parameters:` through HYPERPARAMETERS_PATH
    (a temporary file, as the runtime writes it) and, returned, the accelerate config its command names and
    the GPU its compute.accelerator_type is (None: one the planner has no figures for, e.g. GPU_1xA10).
    A `--model_name_or_path` among the overrides is the config the check plans on too."""
    import atexit
    import tempfile

    from sft_recipes.config import parse_cli_overrides

    model = parse_cli_overrides(overrides).get("model_name_or_path")
    problems = check_workload(path, str(model) if model else None)
    errors = [p for p in problems if not p.warning]
    for line in format_problems(path, [p for p in problems if p.warning] + errors[:-1]):
        print(line, file=sys.stderr)
    if errors:
        raise RecipeError(f"{path}: {errors[-1].message}")
    workload = yaml.safe_load(Path(path).read_text())
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="parameters-", delete=False) as parameters:
        yaml.safe_dump(dict(workload.get("parameters") or {}), parameters)
    atexit.register(os.unlink, parameters.name)
    os.environ[PARAMETERS_ENV] = parameters.name
    launch = launched(workload["command"], workload.get("env_variables") or {})
    code_source = workload.get("code_source") or {}
    root = Path(path).parent / str(code_source.get("snapshot", code_source).get("root_path") or ".")
    return str(Path(os.path.relpath(root / launch.config))), PLANNED_GPU.get(workload["compute"]["accelerator_type"])


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m sft_recipes.workload", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="check workload files offline; exit 2 on any error")
    check.add_argument("workloads", nargs="+")
    check.add_argument("--model-config", help="plan on this config.json (or model directory) instead of the Hub cache")
    args = parser.parse_args(argv)
    failed = False
    for path in args.workloads:
        problems = check_workload(path, args.model_config)
        for line in format_problems(path, problems):
            print(line, file=sys.stderr)
        failed |= any(not p.warning for p in problems)
        if not any(not p.warning for p in problems):
            print(f"ok: {path} (structure as the runtime's CLI checks it, and against its config, recipe and pins; "
                  "the server-side `databricks air run --dry-run` checks are not reproduced)")
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
