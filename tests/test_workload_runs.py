"""workloads/llama8b.yaml's own `command`, run here the way Databricks AI Runtime runs it: once per node, as
2 simulated nodes x 1 CPU process, with the variables the runtime sets (NUM_NODES, NODE_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, CODE_SOURCE_PATH, the workload's env_variables, and HYPERPARAMETERS_PATH holding its
`parameters:` block), the CPU accelerate config and the tiny twin substituted through the variables the command
honours (SFT_ACCELERATE_CONFIG, SFT_RECIPE, SFT_ARGS). The command runs twice: killed on both nodes after a
checkpoint, then again (the runtime's retry), which trains to the end, exports and reloads; the keys set only in
`parameters:` reach the run; the retry's later losses are those of an uninterrupted run of the same recipe and
parameters on 2 processes (through the test launcher: each real invocation of the command costs ~30 s of start-up
on 2 cores, the per-node preflight's imports included, and the reference needs none of it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT, TINY_LLAMA_RECIPE, bin_path, free_port, launch_sft, read_summary
from fault_helpers import _children
from sft_recipes.fault.checkpoints import COMPLETION_MARKER

pytestmark = pytest.mark.fsdp

WORKLOAD = yaml.safe_load((REPO_ROOT / "workloads" / "llama8b.yaml").read_text())
STEPS, SAVE_EVERY = 8, 4
NODES = 2
TIMEOUT = 600


def write_parameters(root: Path) -> Path:
    """The workload's `parameters:` block as the runtime writes it, for HYPERPARAMETERS_PATH."""
    parameters = root / "hyperparameters.yaml"
    parameters.write_text(yaml.safe_dump(WORKLOAD["parameters"]))
    return parameters


def start_nodes(output_dir: Path, root: Path) -> list[subprocess.Popen]:
    """The workload's command, once per simulated node, each in its own process group (like a container)."""
    parameters = write_parameters(root)
    port = free_port()
    nodes = []
    for rank in range(NODES):
        env = {**os.environ, **{k: str(v) for k, v in WORKLOAD["env_variables"].items()},
               "PATH": f"{Path(bin_path('python')).parent}:{os.environ['PATH']}",
               "CODE_SOURCE_PATH": str(REPO_ROOT), "NUM_NODES": str(NODES), "NODE_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "HYPERPARAMETERS_PATH": str(parameters),
               "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",  # the runtime injects its own
               "HF_HOME": str(root / "hf"), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
               "SFT_ACCELERATE_CONFIG": "accelerate_configs/fsdp2_cpu.yaml", "SFT_RECIPE": "recipes/tiny/llama8b.yaml",
               "SFT_ARGS": f"--output_dir {output_dir} --max_steps {STEPS} --save_steps {SAVE_EVERY}"}
        log = open(root / f"node{rank}-{output_dir.name}-{time.monotonic_ns()}.log", "w")
        nodes.append(subprocess.Popen(["bash", "-c", WORKLOAD["command"]], cwd="/", env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    return nodes


def kill_node(node: subprocess.Popen) -> None:
    """SIGKILL everything one node runs, as a lost container would lose it: torchrun starts each worker in a
    session of its own, so the node's process group alone would leave the workers training."""
    tree, pending = [], [node.pid]
    while pending:
        pid = pending.pop()
        tree.append(pid)
        pending += _children(pid)
    for pid in reversed(tree):  # the workers first, the shell last
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait(nodes: list[subprocess.Popen]) -> list[int]:
    deadline = time.monotonic() + TIMEOUT
    while any(node.poll() is None for node in nodes) and time.monotonic() < deadline:
        time.sleep(0.2)
    for node in nodes:
        if node.poll() is None:
            kill_node(node)
    return [node.wait() for node in nodes]


def logs(root: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(root.glob("node*.log")))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("workload")
    # The uninterrupted reference: the same recipe, parameters and command-line keys on 2 processes
    reference = root / "reference"
    launch_sft(TINY_LLAMA_RECIPE, "--output_dir", str(reference), "--max_steps", str(STEPS),
               "--save_steps", str(SAVE_EVERY), "--report_to", "none",
               env={"HYPERPARAMETERS_PATH": str(write_parameters(root))})

    interrupted = root / "interrupted"
    nodes = start_nodes(interrupted, root)
    deadline = time.monotonic() + TIMEOUT
    while not (interrupted / f"checkpoint-{SAVE_EVERY}" / COMPLETION_MARKER).is_file():
        assert all(node.poll() is None for node in nodes), f"a node ended before checkpoint-{SAVE_EVERY}:\n{logs(root)}"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for node in nodes:  # the runtime's view of a failure: every node's container is gone at once
        kill_node(node)
    killed = [node.wait() for node in nodes]
    killed_before_the_end = not (interrupted / "run_summary.json").is_file()
    codes = wait(start_nodes(interrupted, root))  # max_retries: the runtime runs the same command again
    assert codes == [0, 0], logs(root)
    return {"root": root, "reference": reference, "interrupted": interrupted, "killed": killed,
            "killed_before_the_end": killed_before_the_end}


def test_the_workload_command_trains_exports_and_reloads_on_two_nodes(runs):
    summary = read_summary(runs["interrupted"])
    assert summary["world_size"] == NODES and summary["steps"] == STEPS
    assert summary["export_max_logit_diff"] is not None and summary["export_max_logit_diff"] < 1e-4
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(runs["interrupted"])
    assert model.config.model_type == "llama" and sum(p.numel() for p in model.parameters()) > 0


def test_keys_set_only_in_parameters_reach_the_run(runs):
    summary = read_summary(runs["interrupted"])
    recipe = yaml.safe_load((REPO_ROOT / "recipes" / "tiny" / "llama8b.yaml").read_text())
    parameters = WORKLOAD["parameters"]
    only_in_parameters = {key for key in parameters
                          if key not in ("output_dir", "max_steps") and parameters[key] != recipe.get(key)}
    assert only_in_parameters >= {"learning_rate", "max_length"}  # the tiny twin's own are 3e-3 and 256
    assert {key: summary["overrides"]["parameters"][key] for key in only_in_parameters} == \
        {key: parameters[key] for key in only_in_parameters}
    # the optimizer really stepped with the parameters' learning rate (constant schedule; the twin's own is 3e-3)
    state = json.loads((runs["interrupted"] / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    assert {entry["learning_rate"] for entry in state["log_history"] if "learning_rate" in entry} == \
        {parameters["learning_rate"]}
    # the command line (SFT_ARGS, after the recipe) wins over parameters: output_dir and max_steps
    assert summary["checkpoint"] == str(runs["interrupted"]) and summary["steps"] == STEPS


def test_a_second_invocation_after_a_kill_resumes_with_the_same_later_losses(runs):
    assert runs["killed_before_the_end"], "the kill came after the run had finished: nothing was interrupted"
    assert all(code != 0 for code in runs["killed"])
    resumed = read_summary(runs["interrupted"])
    assert resumed["resumed_from"] and Path(resumed["resumed_from"]).name.startswith("checkpoint-")
    resumed_step = int(Path(resumed["resumed_from"]).name.split("-")[1])
    assert resumed_step >= SAVE_EVERY and resumed["steps_this_run"] == STEPS - resumed_step
    reference = read_summary(runs["reference"])["losses"]
    later = {step: loss for step, loss in resumed["losses"].items() if int(step) > resumed_step}
    assert later and later == {step: reference[step] for step in later}
