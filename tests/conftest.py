"""Shared test fixtures: paths, and a runner for real `accelerate launch` jobs on CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parents[1]
# Real chat templates, configs and data rows with their sources: byte-for-byte copies of the team's
# shared/realworld/ (laid beside every checkout and CI clone), so a clone on its own tests the same.
SHARED_REALWORLD = REPO_ROOT.parent / "shared" / "realworld"
REALWORLD = REPO_ROOT / "data" / "realworld"
CPU_CONFIG = REPO_ROOT / "accelerate_configs" / "fsdp2_cpu.yaml"
HSDP_CPU_CONFIG = REPO_ROOT / "accelerate_configs" / "hsdp_cpu.yaml"  # 4 processes: 2 replicas x 2 shards
TINY_LLAMA_RECIPE = REPO_ROOT / "recipes" / "tiny" / "llama8b.yaml"


def reference_recipes():
    """benchmarks/reference_recipes.py: the seeds' data code, transcribed once for the benchmarks and the tests."""
    spec = importlib.util.spec_from_file_location("reference_recipes", REPO_ROOT / "benchmarks" / "reference_recipes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bin_path(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def run_command(cmd: list[str], env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, cwd=REPO_ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def launch_sft(recipe: Path, *overrides: str, nproc: int = 2, env: dict[str, str] | None = None,
               check: bool = True, config: Path = CPU_CONFIG) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file fsdp2_cpu.yaml scripts/sft.py RECIPE ...` on its own port."""
    cmd = [bin_path("accelerate"), "launch", "--config_file", str(config), "--num_processes", str(nproc),
           "--main_process_port", str(free_port()), "scripts/sft.py", str(recipe), *overrides]
    result = run_command(cmd, env)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


def read_summary(output_dir: Path) -> dict:
    return json.loads((Path(output_dir) / "run_summary.json").read_text())


def assert_resume_reproduces(full_dir: Path, resumed_dir: Path, checkpoint_step: int, atol: float) -> None:
    """The resumed run started from checkpoint-N and logged the uninterrupted run's later losses, step for step;
    its summary keeps the losses before N as the checkpoint logged them (on the full run's layout or another)."""
    full, resumed = read_summary(full_dir), read_summary(resumed_dir)
    assert resumed["resumed_from"].endswith(f"checkpoint-{checkpoint_step}") and resumed["steps"] == full["steps"]
    later = {step: loss for step, loss in full["losses"].items() if int(step) > checkpoint_step}
    assert later and list(resumed["losses"]) == list(full["losses"])
    for step, loss in full["losses"].items():
        assert resumed["losses"][step] == pytest.approx(loss, abs=atol), step


@pytest.fixture(scope="session")
def realworld() -> Path:
    return REALWORLD


def write_uneven_shards(path: Path, rows: int) -> Path:
    """Even rows ~40x longer than odd ones: on an even number of ranks the even ranks read the long rows.

    Readers split a one-file stream row by row: reader `worker * world + rank` of `world * readers_per_rank`
    (`data.blocks.reader_index`) reads rows i with i % (world * readers_per_rank) equal to its number, so
    rank r's readers read the rows i with i % world == r.
    """
    with open(path, "w") as f:
        for i in range(rows):
            answer = " ".join(["long answer words"] * 40) if i % 2 == 0 else "short"
            f.write(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path


@pytest.fixture(scope="module")
def single_rank_group(tmp_path_factory):
    """A one-process gloo group, for FSDP2 code that needs a process group but no second rank."""
    assert not dist.is_initialized(), "another test left a process group behind"
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


LAUNCH_ENV_PREFIXES = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")  # what an accelerate config exports


@pytest.fixture(autouse=True)
def no_launch_environment_left_behind():
    """Every test leaves the launch variables as it found them: one that exports a config into the pytest process
    changes what every later in-process run (train() under a decorator stand-in, lint) reads."""
    before = {name: value for name, value in os.environ.items() if name.startswith(LAUNCH_ENV_PREFIXES)}
    yield
    after = {name: value for name, value in os.environ.items() if name.startswith(LAUNCH_ENV_PREFIXES)}
    assert after == before, f"the test changed the launch environment: {sorted(set(after.items()) ^ set(before.items()))}"
