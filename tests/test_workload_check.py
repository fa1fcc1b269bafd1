"""`python -m sft_recipes.workload check`: every shipped workload passes; one broken copy per rule gives exactly
that rule's one line (the runtime's rules from the Databricks CLI, and ours across files), exit 2."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT, bin_path, run_command
from sft_recipes.workload import check_workload, header_variants, launched

WORKLOADS = REPO_ROOT / "workloads"
CONFIGS = REPO_ROOT / "data" / "realworld" / "model_configs"
MODEL_CONFIGS = {  # the planner's offline copies of each workload's model config
    "llama8b.yaml": CONFIGS / "meta-llama__Llama-3.1-8B.json",
    "qwen27b.yaml": CONFIGS / "Qwen__Qwen3.5-27B.derived.json",
    "qwen27b-h100.yaml": CONFIGS / "Qwen__Qwen3.5-27B.derived.json",
    "gptoss120b.yaml": CONFIGS / "openai__gpt-oss-120b.derived.json",
}
SHIPPED = sorted(path.name for path in WORKLOADS.glob("*.yaml"))
UUID = "12345678-90ab-cdef-1234-567890abcdef"


def test_every_workload_is_shipped_with_its_model_config():
    assert SHIPPED == sorted(MODEL_CONFIGS)


PLACEHOLDER_VOLUME = ("output_dir '/Volumes/main/default/{}' is the example's placeholder volume (catalog main, "
                      "schema default): ")
TO_PARAMETERS = "set parameters.output_dir to a volume you can write, /Volumes/<catalog>/<schema>/<volume>/..."
PLACEHOLDERS = {  # what only the user knows, warned about until replaced
    "gptoss120b.yaml": [PLACEHOLDER_VOLUME.format("checkpoints/gpt-oss-120b-peft")
                        + "set env_variables UC_CATALOG, UC_SCHEMA and UC_VOLUME to a volume you can write"],
    "llama8b.yaml": ["secrets.HF_TOKEN 'my_scope/hf_token' is the example's placeholder: replace it with the scope/key "
                     "of your Databricks secret (`databricks secrets list-scopes`)",
                     PLACEHOLDER_VOLUME.format("air_checkpoints/llama31-8b-sft") + TO_PARAMETERS],
    "qwen27b.yaml": [PLACEHOLDER_VOLUME.format("air_checkpoints/qwen3-8-27b-sft") + TO_PARAMETERS],
    "qwen27b-h100.yaml": [PLACEHOLDER_VOLUME.format("air_checkpoints/qwen3-8-27b-sft-h100") + TO_PARAMETERS],
}


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_workload_passes_the_check_warning_of_its_placeholders(name):
    problems = check_workload(WORKLOADS / name, str(MODEL_CONFIGS[name]))
    assert all(p.warning for p in problems) and [p.message for p in problems] == PLACEHOLDERS[name]


def replace_placeholders(workload: dict) -> None:
    """What a user does first with a copy of a shipped workload: their own secret and volume."""
    for name, reference in (workload.get("secrets") or {}).items():
        workload["secrets"][name] = reference.replace("my_scope/", "ml_team/")
    if "output_dir" in (workload.get("parameters") or {}):
        workload["parameters"]["output_dir"] = workload["parameters"]["output_dir"].replace("/main/default/", "/ml/sft/")
    if "UC_CATALOG" in (workload.get("env_variables") or {}):
        workload["env_variables"].update(UC_CATALOG="ml", UC_SCHEMA="sft")


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_workload_header_gives_hardware_launch_command_and_differences(name):
    text = (WORKLOADS / name).read_text()
    header = text.split("\n\n")[0]
    assert re.search(r"GPU_8x(H100|B300)", header.splitlines()[0] + header.splitlines()[1]), header
    assert f"databricks air run -f workloads/{name}" in header
    assert f".venv/bin/python -m sft_recipes.workload check workloads/{name}" in header
    assert "Differences from the seed" in header and "Reference: shared/seeds/" in header
    workload = yaml.safe_load(text)
    assert workload["max_retries"] >= 1 and workload["code_source"] == {"root_path": ".."}
    launch = launched(workload["command"], workload.get("env_variables", {}))
    recipe = yaml.safe_load((REPO_ROOT / launch.recipe).read_text())
    assert recipe["resume_from_checkpoint"] == "auto", "a retry must continue, not start over"
    assert all("SFT_" + name in workload["command"] for name in ("ACCELERATE_CONFIG", "RECIPE", "ARGS"))


def test_the_qwen_h100_workload_uses_the_recipe_headers_sequence_parallel_variant():
    parameters = yaml.safe_load((WORKLOADS / "qwen27b-h100.yaml").read_text())["parameters"]
    assert "--sequence_parallel_size 4" in header_variants(REPO_ROOT / "recipes" / "qwen27b.yaml")
    assert parameters["sequence_parallel_size"] == 4 and "gradient_accumulation_steps" not in parameters  # derived


def _set(path: str, value):
    def edit(workload):
        *parents, leaf = path.split(".")
        node = workload
        for key in parents:
            node = node.setdefault(key, {})
        if value is DELETE:
            del node[leaf]
        else:
            node[leaf] = value
    return edit


DELETE = object()
LONG_COMMAND = "cd \"$CODE_SOURCE_PATH\"\n" + "true\n" * 1000 + "scripts/launch_multinode.sh accelerate_configs/fsdp2_2node.yaml recipes/llama8b.yaml\n"

# (rule, the edit on a copy of workloads/llama8b.yaml, the start of the one line it must produce)
BROKEN = [
    # the runtime's rules (databricks/cli cmd/air, experimental/air)
    ("unknown key", _set("retries", 2), "workload: unknown key 'retries' (the runtime refuses the file): did you mean 'max_retries'?"),
    ("unknown nested key", _set("compute.gpus", 16), "compute: unknown key 'gpus'"),
    ("required field", _set("experiment_name", DELETE), "experiment_name is required"),
    ("task key characters", _set("experiment_name", "air multinode"), "experiment_name 'air multinode' has characters"),
    ("task key length", _set("experiment_name", "x" * 101), "experiment_name has 101 characters"),
    ("accelerator type", _set("compute.accelerator_type", "GPU_8xh100"), "compute.accelerator_type 'GPU_8xh100' is not"),
    ("whole nodes", _set("compute.num_accelerators", 12), "compute.num_accelerators 12 is not a multiple of 8"),
    ("positive count", _set("compute.num_accelerators", 0), "compute.num_accelerators 0 must be a positive"),
    ("priority needs a pool", _set("compute.priority_class", "normal"), "compute.priority_class needs compute.pool_id"),
    ("dependencies are a list", _set("environment.dependencies", "requirements.txt"),
     "environment.dependencies must be a list"),
    ("version form", _set("environment.version", "latest"), "environment.version 'latest' must be an integer"),
    ("databricks_ai_v needs 5+", _set("environment.version", "databricks_ai_v4"),
     "environment.version 'databricks_ai_v4': the databricks_ai_v prefix needs version 5"),
    ("image excludes dependencies", _set("environment.unity_catalog_image", "main.default.train:v3"),
     "environment.unity_catalog_image excludes dependencies and version"),
    ("command length", _set("command", LONG_COMMAND), "command has 1003 lines (the runtime allows 1000)"),  # counts newlines + 1
    ("secret reference", _set("secrets.HF_TOKEN", "my_scope"), "secrets.HF_TOKEN 'my_scope' must be 'scope/key'"),
    ("env and secret", _set("env_variables.HF_TOKEN", "hf_x"), "HF_TOKEN is in both env_variables and secrets"),
    ("root_path", _set("code_source.root_path", " "), "code_source.root_path is missing"),
    ("nested form type", _set("code_source", {"type": "git", "snapshot": {"root_path": str(REPO_ROOT)}}),
     "code_source.type 'git' must be 'snapshot'"),
    ("include paths", _set("code_source.include_paths", ["../outside"]), "code_source.include_paths entry '../outside'"),
    ("git ref", _set("code_source.git", {"branch": "main", "commit": "abc"}), "code_source.git needs exactly one of"),
    ("max_retries", _set("max_retries", -1), "max_retries -1 must be a whole number >= 0"),
    ("timeout", _set("timeout_minutes", 0), "timeout_minutes 0 must be a whole number >= 1"),
    ("mlflow directory", _set("mlflow_experiment_directory", "/Users/me"), "mlflow_experiment_directory '/Users/me'"),
    ("usage policy", lambda w: w.update(usage_policy_name="gpu", usage_policy_id=UUID),
     "usage_policy_name and usage_policy_id exclude each other"),
    ("permissions", _set("permissions", [{"user_name": "a@b.c", "group_name": "ml", "level": "CAN_VIEW"}]),
     "permissions[0] names 2 principals"),
    # ours, across files
    ("launches through the launcher", _set("command", "python train.py"),
     "command does not run scripts/launch_multinode.sh"),
    ("launched files exist", _set("command", "scripts/launch_multinode.sh accelerate_configs/nope.yaml recipes/llama8b.yaml"),
     "the command launches accelerate config accelerate_configs/nope.yaml, which"),
    ("GPUs = nodes x processes", _set("compute.num_accelerators", 8),
     "compute asks for 8 GPUs (1 node(s) x 8 GPU_8xH100) but accelerate_configs/fsdp2_2node.yaml launches 2 machine(s)"),
    ("recipe loads", _set("parameters.max_steps", "many"), "the recipe with parameters and the command's overrides does not load"),
    ("plan fits", _set("parameters.max_length", 65536), "the plan needs "),
    ("gated model token", _set("secrets", DELETE), "meta-llama/Llama-3.1-8B is gated on the Hugging Face Hub"),
    ("parameters are recipe keys", _set("parameters.max_seq_len", 1024),
     "parameters.max_seq_len is not a recipe key: did you mean 'max_length'?"),
    ("no secret in parameters", _set("parameters.hub_token", "hf_x"), "parameters.hub_token would write a secret"),
    ("pins", lambda w: w["environment"]["dependencies"].__setitem__(0, "transformers>=4.45,<5"),
     "environment.dependencies 'transformers>=4.45,<5' contradicts requirements.txt (transformers==5.23.0"),
    ("one experiment", _set("experiment_name", "another-experiment"),
     "experiment_name 'another-experiment' and the recipe's mlflow_experiment_name 'air-multinode-llama-sft' disagree"),
    ("retries resume", _set("parameters.resume_from_checkpoint", None),
     "max_retries 3 re-runs the command after a failure but the recipe's resume_from_checkpoint is None"),
]


def broken_copy(tmp_path: Path, edit, base: str = "llama8b.yaml") -> Path:
    workload = yaml.safe_load((WORKLOADS / base).read_text())
    workload["code_source"]["root_path"] = str(REPO_ROOT)  # the copy lives elsewhere
    workload = copy.deepcopy(workload)
    replace_placeholders(workload)
    edit(workload)
    path = tmp_path / base
    path.write_text(yaml.safe_dump(workload, sort_keys=False))
    return path


@pytest.mark.parametrize(("rule", "edit", "line"), BROKEN, ids=[case[0] for case in BROKEN])
def test_one_broken_copy_per_rule_gives_exactly_that_rules_line(rule, edit, line, tmp_path):
    problems = check_workload(broken_copy(tmp_path, edit), str(MODEL_CONFIGS["llama8b.yaml"]))
    assert [p.message[:len(line)] for p in problems] == [line], problems
    assert not problems[0].warning


def test_a_plan_that_does_not_fit_names_the_shortfall_and_the_header_variant_that_fits(tmp_path):
    def without_sp(workload):
        del workload["parameters"]["sequence_parallel_size"]

    problems = check_workload(broken_copy(tmp_path, without_sp, "qwen27b-h100.yaml"), str(MODEL_CONFIGS["qwen27b.yaml"]))
    assert [p.message for p in problems] == [
        "the plan needs 100.0 GiB per GPU and GPU_8xH100's H100 has 79.6: 20.4 GiB short; the recipe header's variant "
        "`--sequence_parallel_size 4` fits (76.9 GiB): add it to parameters"]


def test_output_dir_off_volumes_is_a_warning_not_an_error(tmp_path):
    problems = check_workload(broken_copy(tmp_path, _set("parameters.output_dir", "outputs/llama")),
                              str(MODEL_CONFIGS["llama8b.yaml"]))
    assert len(problems) == 1 and problems[0].warning
    assert problems[0].message.startswith("output_dir 'outputs/llama' is not on a /Volumes/ path")


def test_a_model_config_missing_from_the_cache_is_a_warning_naming_the_config_to_pass(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))  # a machine that never downloaded it
    not_planned = "the memory plan was not checked: {0} is not in the Hugging Face cache and the planner never downloads: "
    download = "or run `.venv/bin/hf download {0} config.json` first"
    problems = check_workload(broken_copy(tmp_path, lambda workload: None))
    assert [(p.message, p.warning) for p in problems] == [(
        not_planned.format("meta-llama/Llama-3.1-8B") + "pass `--model-config "
        "data/realworld/model_configs/meta-llama__Llama-3.1-8B.json` (shipped with this clone), "
        + download.format("meta-llama/Llama-3.1-8B"), True)]
    problems = check_workload(broken_copy(tmp_path, _set("parameters.model_name_or_path", "acme/private-8b")))
    assert [(p.message, p.warning) for p in problems] == [(
        not_planned.format("acme/private-8b") + "pass `--model-config CONFIG.json` (the model's config.json, or its "
        "directory), " + download.format("acme/private-8b"), True)]


@pytest.mark.slow
def test_every_problem_at_once_one_line_each_exit_2(tmp_path):
    def two_wrongs(workload):
        workload["compute"]["accelerator_type"] = "H100"
        workload["parameters"]["max_seq_len"] = 1024

    broken = broken_copy(tmp_path, two_wrongs)
    result = run_command([bin_path("python"), "-m", "sft_recipes.workload", "check", str(broken),
                          "workloads/qwen27b.yaml", "--model-config", str(MODEL_CONFIGS["llama8b.yaml"])])
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert [line.split(": ", 2)[2][:40] for line in errors] == [
        "compute.accelerator_type 'H100' is not a", "parameters.max_seq_len is not a recipe k"], result.stderr
    assert "ok: workloads/qwen27b.yaml" in result.stdout


@pytest.mark.slow
def test_dry_run_with_workload_checks_it_and_plans_its_parameters(tmp_path):
    command = [bin_path("python"), "scripts/sft.py", "recipes/qwen27b.yaml", "--dry-run", "--model_name_or_path",
               str(MODEL_CONFIGS["qwen27b.yaml"])]
    result = run_command([*command, "--workload", "workloads/qwen27b-h100.yaml"])
    assert result.returncode == 0, result.stderr
    assert "SP 4: 2 groups of 4 devices" in result.stdout  # the workload's parameters, as HYPERPARAMETERS_PATH
    assert re.search(r"H100\s+79\.6\s+yes", result.stdout)
    # The workload's GPU_8xH100, not the recipe header's B300, is what the estimate and suggestions are for.
    assert "communication per optimizer step per GPU on H100 (--gpu)" in result.stdout
    broken = broken_copy(tmp_path, _set("compute.accelerator_type", "GPU_8xA100"))
    result = run_command([*command, "--workload", str(broken)])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {broken}: compute.accelerator_type 'GPU_8xA100'")


def test_a_bad_parameters_value_names_parameters_not_the_recipe_file(tmp_path):
    problems = check_workload(broken_copy(tmp_path, _set("parameters.max_steps", "many")),
                              str(MODEL_CONFIGS["llama8b.yaml"]))
    recipe = REPO_ROOT / "recipes" / "llama8b.yaml"
    assert [p.message for p in problems] == [
        f"the recipe with parameters and the command's overrides does not load: {recipe}: 'max_steps' must be an "
        f"integer, got 'many' (str) (set in llama8b.yaml parameters:). Fix each where it is set (in parentheses), else "
        f"in {recipe}."]
