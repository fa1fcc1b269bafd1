"""GPU launches on a machine without the GPUs they need: one line, exit 2, before any process starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import REPO_ROOT, TINY_LLAMA_RECIPE, bin_path, run_command
from sft_recipes.preflight_launch import preflight


@pytest.mark.parametrize(("config", "recipe"), [("fsdp2_8gpu.yaml", "qwen27b.yaml"), ("fsdp2_8gpu.yaml", "gptoss120b.yaml"),
                                                ("fsdp2_2node.yaml", "llama8b.yaml")])
def test_gpu_recipe_without_gpus_is_refused_with_what_to_run_instead(config, recipe):
    problem = preflight(f"accelerate_configs/{config}", f"recipes/{recipe}", None, gpu_count=0)
    assert problem.startswith(f"accelerate_configs/{config} + recipes/{recipe} need 8 GPU(s) on this node")
    assert "this machine has no GPU" in problem and "`make demo`" in problem and "--dry-run" in problem


def test_enough_gpus_or_a_cpu_run_go_ahead():
    assert preflight("accelerate_configs/fsdp2_8gpu.yaml", "recipes/qwen27b.yaml", None, gpu_count=8) is None
    assert preflight("accelerate_configs/fsdp2_cpu.yaml", "recipes/tiny/llama8b.yaml", None, gpu_count=0) is None
    assert "need 8 GPU(s)" in preflight("accelerate_configs/fsdp2_8gpu.yaml", "recipes/qwen27b.yaml", None, gpu_count=4)
    # launch_multinode.sh passes the processes it will start on this node (its GPU count when it sees GPUs)
    assert preflight("accelerate_configs/fsdp2_2node.yaml", "recipes/llama8b.yaml", 4, gpu_count=4) is None


def test_launch_script_stops_before_starting_anything():
    result = run_command(["bash", str(REPO_ROOT / "scripts" / "launch_multinode.sh"), "accelerate_configs/fsdp2_2node.yaml",
                          "recipes/llama8b.yaml"],
                         env={"PATH": f"{Path(bin_path('python')).parent}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: accelerate_configs/fsdp2_2node.yaml + recipes/llama8b.yaml"), lines
    assert "[launch]" not in result.stderr  # accelerate was never started


@pytest.mark.parametrize("variables, line", [
    ({"NUM_NODES": "two"}, "error: NUM_NODES=two: give the number of nodes of the launch, a whole number >= 1 (unset: 1)"),
    ({"NUM_NODES": "0"}, "error: NUM_NODES=0: give the number of nodes of the launch, a whole number >= 1 (unset: 1)"),
    ({"LOCAL_WORLD_SIZE": "0"}, "error: LOCAL_WORLD_SIZE=0: give the processes (GPUs) of this node, a whole number >= 1 "
                                "(unset: this node's GPUs)"),
    ({"NUM_NODES": "2", "NODE_RANK": "2"}, "error: NODE_RANK=2: give this node's rank, 0 to 1 for NUM_NODES=2 (unset: 0)"),
    ({"MASTER_PORT": "abc"}, "error: MASTER_PORT=abc: give node 0's rendezvous port, 1 to 65535, the same on every node "
                             "(unset: 29500)"),
])
def test_a_wrong_cluster_variable_is_one_line_naming_it(variables, line):
    """Were bash's 'two: unbound variable', an AssertionError traceback, a node 2 of 2 waiting for a rendezvous no
    node joins, and accelerate's usage block."""
    result = run_command(["bash", str(REPO_ROOT / "scripts" / "launch_multinode.sh"), "accelerate_configs/fsdp2_cpu.yaml",
                          "recipes/tiny/llama8b.yaml"], env={"LOCAL_WORLD_SIZE": "1", **variables}, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", line + "\n")


def _refused_before_any_process(result, problem: str) -> None:
    """Exit 2, one `error:` line naming the problem, and nothing from accelerate or torchrun."""
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("error: ") and problem in errors[0], errors
    for launcher_output in ("[launch]", "Traceback", "ChildFailedError", "torch.distributed", "exitcode"):
        assert launcher_output not in result.stdout + result.stderr, launcher_output


@pytest.mark.slow
def test_a_bad_override_through_the_launcher_is_one_line_before_torchrun():
    env = {"PATH": f"{Path(bin_path('python')).parent}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": ""}
    result = run_command(["bash", str(REPO_ROOT / "scripts" / "launch_multinode.sh"), "accelerate_configs/fsdp2_cpu.yaml",
                          "recipes/tiny/llama8b.yaml", "--max_steps", "2", "--learning_rate", "-1"], env=env)
    _refused_before_any_process(result, "'learning_rate' must be a finite number > 0, got -1")
    # the world size the launch would make (NUM_NODES x LOCAL_WORLD_SIZE) reaches the linter
    result = run_command(["bash", str(REPO_ROOT / "scripts" / "launch_multinode.sh"), "accelerate_configs/fsdp2_cpu.yaml",
                          "recipes/tiny/llama8b.yaml", "--sequence_parallel_size", "3", "--pack_blocks", "true"],
                         env={**env, "NUM_NODES": "2", "LOCAL_WORLD_SIZE": "2"})
    _refused_before_any_process(result, "sequence_parallel_size=3 must divide the world size 4; use one of [1, 2, 4]")


@pytest.mark.slow
def test_a_bad_override_through_make_demo_is_one_line_and_the_last_demo_is_kept(tmp_path):
    last_demo = tmp_path / "demo"
    last_demo.mkdir()
    (last_demo / "run_summary.json").write_text("{}")
    # -o: the venv is there (this interpreter's); make must not rebuild it from a fresh checkout's timestamps
    result = run_command(["make", "-s", "-o", ".venv/.installed", "demo", f"PY={bin_path('python')}",
                          f"DEMO_DIR={last_demo}", "ARGS=--dataset_name data/samples/nope.jsonl"])
    _refused_before_any_process(result, "Dataset file not found: data/samples/nope.jsonl (dataset_name)")
    assert (last_demo / "run_summary.json").is_file()  # refused before `rm -rf` of the last demo


def test_a_launch_of_the_dry_run_or_the_data_audit_is_refused_with_the_command_that_runs_it(capsys):
    """`make train ARGS="--dry-run"` read --dry-run as an unknown recipe key 'dry_run'."""
    from sft_recipes.command_line import options_that_do_not_train
    from sft_recipes.preflight_launch import main

    recipe = "recipes/tiny/llama8b.yaml"
    assert options_that_do_not_train(recipe, ["--max_steps", "3", "--output_dir", "x"]) == []
    assert options_that_do_not_train(recipe, ["--plan_memory_headroom_gib", "3"]) == []  # no abbreviation of --plan-json
    assert options_that_do_not_train(recipe, ["--dry-run", "--max_steps", "3", "--gpu", "H200"]) == ["--dry-run", "--gpu"]
    assert main(["accelerate_configs/fsdp2_cpu.yaml", recipe, "--", "--audit-data", "3", "--max_steps", "2"]) == 2
    assert capsys.readouterr().err == (
        "error: --audit-data is scripts/sft.py's own option: the dry run and the data audit run in one process instead "
        f"of training, so they are not launched: run `.venv/bin/python scripts/sft.py {recipe} --audit-data 3 "
        "--max_steps 2`\n")


def test_recipe_check_passes_every_shipped_cpu_launch():
    from sft_recipes.preflight_launch import recipe_refusal

    for recipe in sorted((REPO_ROOT / "recipes" / "tiny").glob("*.yaml")):
        assert recipe_refusal("accelerate_configs/fsdp2_cpu.yaml", str(recipe), [], None, has_accelerator=False) is None


def test_a_model_path_that_is_not_here_is_refused_before_the_launch(tmp_path, monkeypatch):
    """Each rank refused it, and torchrun's report of failed ranks followed; a Hub id is left to the run."""
    from sft_recipes.preflight_launch import recipe_refusal

    import sft_recipes.loading as loading

    (tmp_path / "outputs" / "demo").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(loading, "hub_unreachable", lambda: "HF_HUB_OFFLINE is set")
    config, recipe = str(REPO_ROOT / "accelerate_configs" / "fsdp2_cpu.yaml"), str(REPO_ROOT / TINY_LLAMA_RECIPE)
    data = ["--dataset_name", str(REPO_ROOT / "data" / "samples" / "alpaca.jsonl")]  # the recipe's, from here
    refusals = {name: recipe_refusal(config, recipe, ["--model_name_or_path", name, *data], None, has_accelerator=False)
                for name in ("outputs/dmeo", "configs/llama.json", "meta-llama/Llama-3.1-8B", "outputs/demo")}
    assert refusals == {
        "outputs/dmeo": "outputs/dmeo is not a folder here (outputs is; it holds demo), and the Hugging Face Hub "
                        "cannot be asked for it (HF_HUB_OFFLINE is set): fix model_name_or_path.",
        "configs/llama.json": "Model config configs/llama.json does not exist: fix model_name_or_path.",
        "meta-llama/Llama-3.1-8B": None, "outputs/demo": None}


def test_a_resume_path_without_a_checkpoint_is_refused_before_the_launch(tmp_path):
    from sft_recipes.preflight_launch import recipe_refusal

    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / "trainer_state.json").write_text("{}")
    refusals = {name: recipe_refusal("accelerate_configs/fsdp2_cpu.yaml", str(TINY_LLAMA_RECIPE),
                                     ["--resume_from_checkpoint", str(tmp_path / name), "--output_dir", str(tmp_path)],
                                     None, has_accelerator=False)
                for name in ("checkpoint-9", "", "checkpoint-3")}
    assert refusals["checkpoint-9"].startswith(f"resume_from_checkpoint='{tmp_path / 'checkpoint-9'}' is not a "
                                               "checkpoint directory. Use 'auto'")
    assert refusals[""].startswith(f"resume_from_checkpoint='{tmp_path}' holds no checkpoint (no trainer_state.json); "
                                   "it holds checkpoint-3: pass one of them.")
    assert refusals["checkpoint-3"] is None


def test_a_config_the_launch_script_cannot_read_is_one_line_before_torchrun():
    env = {"PATH": f"{Path(bin_path('python')).parent}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": ""}
    result = run_command(["bash", str(REPO_ROOT / "scripts" / "launch_multinode.sh"), "accelerate_configs/fsdp2_cpus.yaml",
                          "recipes/tiny/llama8b.yaml"], env=env)
    _refused_before_any_process(result, "accelerate config not found: accelerate_configs/fsdp2_cpus.yaml")


@pytest.mark.parametrize(("config", "per_node"), [("fsdp2_cpu.yaml", "2"), ("fsdp2_2node.yaml", "8"), ("hsdp_cpu.yaml", "4")])
def test_processes_per_node_is_what_the_launch_script_starts_without_gpus(config, per_node):
    result = run_command([bin_path("python"), "-m", "sft_recipes.launch", "processes-per-node", f"accelerate_configs/{config}"])
    assert (result.returncode, result.stdout.strip()) == (0, per_node), result.stderr


SHIPPED_CONFIGS = ", ".join(sorted(f"accelerate_configs/{p.name}" for p in (REPO_ROOT / "accelerate_configs").glob("*.yaml")))
SHIPPED_RECIPES = ", ".join(sorted(p.relative_to(REPO_ROOT).as_posix() for pattern in ("*.yaml", "*/*.yaml")
                                   for p in (REPO_ROOT / "recipes").glob(pattern)))
BROKEN_YAML = ("is not valid YAML: while parsing a flow sequence in \"<unicode string>\", line 1, column 12: max_steps: [4 "
               "^ expected ',' or ']', but got '<stream end>' in \"<unicode string>\", line 2, column 1: ^. Fix the YAML at "
               "the line and column named (one `key: value` per line).")


@pytest.fixture
def bad_files(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    (tmp_path / "broken.yaml").write_text("max_steps: [4\n")
    (tmp_path / "list.yaml").write_text("- max_steps: 4\n")
    return tmp_path


@pytest.mark.parametrize(("config", "recipe", "expected"), [
    ("accelerate_configs/fsdp2_cpu.yaml", "{tmp}/broken.yaml", "{tmp}/broken.yaml " + BROKEN_YAML),
    ("accelerate_configs/fsdp2_cpu.yaml", "{tmp}/list.yaml",
     "{tmp}/list.yaml must be a mapping of key: value, got list: write one `key: value` per line, as in "
     "recipes/tiny/llama8b.yaml."),
    ("{tmp}/broken.yaml", "recipes/tiny/llama8b.yaml", "{tmp}/broken.yaml " + BROKEN_YAML),
    ("{tmp}/list.yaml", "recipes/tiny/llama8b.yaml",
     "{tmp}/list.yaml is not an accelerate config: it must be a mapping of key: value, got list. Pass the path of an "
     f"accelerate config file: one of {SHIPPED_CONFIGS}."),
    ("recipes/tiny/llama8b.yaml", "recipes/tiny/llama8b.yaml",
     "recipes/tiny/llama8b.yaml is not an accelerate config: it has no distributed_type, which accelerate launch "
     f"requires (it reads like a recipe). Pass the path of an accelerate config file: one of {SHIPPED_CONFIGS}."),
    ("accelerate_configs/fsdp2_cpu.yaml", "recipes",
     f"recipes is a folder, not a recipe file. Pass the path of a recipe YAML: one of {SHIPPED_RECIPES}."),
    ("accelerate_configs", "recipes/tiny/llama8b.yaml",
     f"accelerate_configs is a folder, not an accelerate config file. Pass the path of an accelerate config file: "
     f"one of {SHIPPED_CONFIGS}."),
    ("accelerate_configs/fsdp2_cpu.yaml", "nope.yaml",
     f"Recipe file not found: nope.yaml. Pass the path of a recipe YAML: one of {SHIPPED_RECIPES}."),
    ("nope.yaml", "recipes/tiny/llama8b.yaml",
     f"accelerate config not found: nope.yaml. Pass the path of an accelerate config file: one of {SHIPPED_CONFIGS}."),
])
def test_a_file_that_is_no_recipe_or_no_accelerate_config_is_sfts_one_line_with_the_fix(bad_files, config, recipe,
                                                                                          expected, capsys):
    from sft_recipes.preflight_launch import main

    config, recipe, expected = (text.replace("{tmp}", str(bad_files)) for text in (config, recipe, expected))
    assert preflight(config, recipe, None, gpu_count=0) == expected
    assert main([config, recipe]) == 2
    assert capsys.readouterr().err == f"error: {expected}\n"


@pytest.mark.slow
def test_make_train_with_a_recipe_as_the_accelerate_config_is_refused_before_accelerate(tmp_path):
    result = run_command(["make", "-s", "-o", ".venv/.installed", "train", f"PY={bin_path('python')}",
                          "CONFIG=recipes/tiny/llama8b.yaml", f"OUT={tmp_path / 'x'}", "ARGS=--max_steps 1"])
    _refused_before_any_process(result, "error: recipes/tiny/llama8b.yaml is not an accelerate config: it has no "
                                         "distributed_type, which accelerate launch requires (it reads like a recipe). "
                                         f"Pass the path of an accelerate config file: one of {SHIPPED_CONFIGS}.")
    for broken in ("RECIPE", "CONFIG"):
        (tmp_path / "broken.yaml").write_text("max_steps: [4\n")
        result = run_command(["make", "-s", "-o", ".venv/.installed", "train", f"PY={bin_path('python')}",
                              f"{broken}={tmp_path / 'broken.yaml'}", f"OUT={tmp_path / 'x'}"])
        _refused_before_any_process(result, f"error: {tmp_path / 'broken.yaml'} {BROKEN_YAML}")
    for emptied in ("RECIPE", "CONFIG"):  # `make train RECIPE=`: said so, not the pre-check's argparse usage
        result = run_command(["make", "-s", "-o", ".venv/.installed", "train", f"PY={bin_path('python')}", f"{emptied}="])
        _refused_before_any_process(result, "error: make train needs a recipe and a config: RECIPE=recipes/... (default "
                                            "recipes/tiny/llama8b.yaml) CONFIG=accelerate_configs/... (default "
                                            "accelerate_configs/fsdp2_cpu.yaml)")
