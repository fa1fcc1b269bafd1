"""Shared test fixtures: paths, and a runner for real `accelerate launch` jobs on CPU."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import sft_recipes  # noqa: F401  first: it drops two library warnings (environment.drop_library_noise) before torchao
import torch._dynamo  # noqa: F401  its import sets TORCHINDUCTOR_CACHE_DIR (torch's cache_dir()): here, before any test
import torch.distributed as dist
from warm_launcher import WarmLauncher, import_time_environment
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: F401  (binds fla's kernels where fla imports)

from sft_recipes.architectures.kernels import use_torch_references_where_triton_cannot_run

# Tests build qwen3_5 models straight from a config; the product loads every model through sft_recipes.loading,
# which puts transformers' torch references back where fla's Triton kernels cannot run. Done here once, so that no
# test's forward depends on which test ran before it in its worker.
use_torch_references_where_triton_cannot_run()

# A rank killed by a fatal signal prints its Python stack (and the warm launcher's forks inherit it). Seen once: rank 0
# of the qwen3_5 eager run in test_compile_runs died of SIGSEGV inside the export's state-dict gather (clean-clone
# suite, 2026-12-05), with no stack to say where; not reproduced in 3 runs alone.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

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


@contextlib.contextmanager
def an_http_server(status: int, body: dict):
    """A server that answers every GET with `status` and the JSON `body` (a stand-in for the Hub or an MLflow
    server); yields its URL and the paths asked."""
    asked = []

    class Answer(BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):  # not on the test's stderr
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Answer) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}", asked
        finally:
            server.shutdown()


@contextlib.contextmanager
def a_proxy_that_closes_every_connection():
    """An HTTPS_PROXY that takes connections and closes them unanswered: a request through it fails at once."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        def close_each():
            with contextlib.suppress(OSError):  # the server closed
                while True:
                    server.accept()[0].close()

        threading.Thread(target=close_each, daemon=True).start()
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


def bin_path(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def command_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", **(env or {})}


_warm: WarmLauncher | None = None


def warm_launcher() -> WarmLauncher:
    """The session's warm launcher (tests/warm_launcher.py), started on first use."""
    global _warm
    if _warm is None:
        workdir = Path(tempfile.mkdtemp(prefix="warm-launcher-"))
        _warm = WarmLauncher(REPO_ROOT, command_environment(), workdir)
    return _warm


def _warm_run(cmd: list[str], env: dict[str, str], timeout: int) -> subprocess.CompletedProcess | None:
    """`python SCRIPT.py ...` or `accelerate launch --config_file C (or --multi_gpu) --num_processes N
    --main_process_port P SCRIPT.py ...` through the warm launcher; None for any other command, or an environment it
    cannot serve."""
    launcher = warm_launcher()
    if os.environ.get("SFT_TESTS_LAUNCHER") == "real" or not launcher.serves(env):
        return None
    # the venv's python by any name: the docs' `.venv/bin/python` is relative to the repository root
    if len(cmd) >= 2 and str(REPO_ROOT / cmd[0]) in (sys.executable, bin_path("python")) and cmd[1].endswith(".py"):
        return launcher.run(cmd[1], cmd[2:], env, timeout)
    if cmd[:2] == [bin_path("accelerate"), "launch"]:
        flags, rest = {}, cmd[2:]
        while rest and rest[0] in ("--config_file", "--num_processes", "--main_process_port", "--multi_gpu"):
            if rest[0] == "--multi_gpu":  # N processes without a config (on CPU: gloo)
                flags[rest[0]], rest = True, rest[1:]
            else:
                flags[rest[0]], rest = rest[1], rest[2:]
        if set(flags) - {"--config_file", "--multi_gpu"} == {"--num_processes", "--main_process_port"} and len(
                set(flags) & {"--config_file", "--multi_gpu"}) == 1 and rest[0].endswith(".py"):
            return launcher.run(rest[0], rest[1:], env, timeout, config=flags.get("--config_file"),
                                nproc=int(flags["--num_processes"]), port=int(flags["--main_process_port"]),
                                multi_gpu="--multi_gpu" in flags)
    return None


def run_command(cmd: list[str], env: dict[str, str] | None = None, timeout: int = 300,
                launcher: str = "warm") -> subprocess.CompletedProcess:
    """Run `cmd` from the repository root. `python SCRIPT` and `accelerate launch` commands go through the warm
    launcher unless `launcher="real"` (or SFT_TESTS_LAUNCHER=real for the whole session): docs/testing.md."""
    full_env, started = command_environment(env), time.monotonic()
    if launcher == "warm" and (result := _warm_run(cmd, full_env, timeout)) is not None:
        log_launch("warm", cmd, started)
        return result
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    differs = sorted(set(import_time_environment(full_env).items()) ^ set(import_time_environment(warm_launcher().env).items()))
    log_launch("real", cmd, started, f"import-time environment differs: {dict(differs)}" if differs else "")
    return result


def log_launch(launcher: str, cmd: list[str], started: float, why: str = "") -> None:
    """With SFT_TESTS_LAUNCH_LOG=FILE, one line per command a test runs: the launcher that served it, its
    wall time and the test (docs/testing.md: which runs go where, and what they cost)."""
    if path := os.environ.get("SFT_TESTS_LAUNCH_LOG"):
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        script = next((part for part in cmd if part.endswith((".py", ".sh"))), cmd[0])
        with open(path, "a") as log:
            log.write(f"{launcher}\t{time.monotonic() - started:.1f}\t{Path(script).name}\t{test}\t{why}\n")


def launch_sft(recipe: Path, *overrides: str, nproc: int = 2, env: dict[str, str] | None = None,
               check: bool = True, config: Path = CPU_CONFIG, launcher: str = "warm") -> subprocess.CompletedProcess:
    """`accelerate launch --config_file fsdp2_cpu.yaml scripts/sft.py RECIPE ...` on its own port."""
    cmd = [bin_path("accelerate"), "launch", "--config_file", str(config), "--num_processes", str(nproc),
           "--main_process_port", str(free_port()), "scripts/sft.py", str(recipe), *overrides]
    result = run_command(cmd, env, launcher=launcher)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


class LoggedMessages(logging.Handler):
    """The messages a logger handled, for a logger that does not propagate to pytest's caplog (transformers')."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


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


# What an accelerate config exports, and MLflow's (a platform injects them: one left behind sent a later run of the
# worker to another experiment, where MLflow refused its injected run)
LAUNCH_ENV_PREFIXES = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_", "MLFLOW_")


@pytest.fixture(autouse=True)
def no_launch_environment_left_behind():
    """Every test leaves the launch variables as it found them: one that exports a config into the pytest process
    changes what every later in-process run (train() under a decorator stand-in, lint) reads. So too the variables
    read at import time (warm_launcher.IMPORT_TIME_PREFIXES): with one changed, every later run of the session
    differs from the warm launcher's environment and goes to the real launcher, at ~10 s more a run."""
    before = {name: value for name, value in os.environ.items() if name.startswith(LAUNCH_ENV_PREFIXES)}
    imports_before = import_time_environment(os.environ)
    yield
    after = {name: value for name, value in os.environ.items() if name.startswith(LAUNCH_ENV_PREFIXES)}
    assert after == before, f"the test changed the launch environment: {sorted(set(after.items()) ^ set(before.items()))}"
    imports_after = import_time_environment(os.environ)
    assert imports_after == imports_before, ("the test changed the import-time environment: "
                                             f"{sorted(set(imports_after.items()) ^ set(imports_before.items()))}")


# ── Areas: `make test-area AREA=data` runs one area's tests, its multi-process runs included (docs/testing.md) ──
AREAS = {
    "data": ("alpaca_chat", "audit", "blocks", "data_validation", "formats", "masking", "masking_real_tokenizers",
             "mixture", "packing", "packing_equivalence", "kernels_interpreter", "reasoning", "sample_data",
             "stream_drops", "vision", "tiny", "passes", "packed_passes_runs", "tools", "turns", "dataset_shapes"),
    "planner": ("plan", "planner_communication", "dry_run", "hsdp_layout", "lint", "benchmarks_smoke", "planner_package",
                "planner_advice"),
    "distributed": ("distributed", "fsdp_cpu", "fsdp_wrap", "global_token_loss", "gptoss_fsdp", "hsdp",
                    "micro_batch_gradients", "qwen_fsdp", "sequence_parallel", "sequence_parallel_runs", "lora",
                    "merge", "mxfp4", "eval_loss", "vision_runs", "in_process", "launch", "bf16_runs", "compile_runs",
                    "fp8", "gpu_check"),
    "fault": ("fault_checkpoints", "fault_guards", "fault_preemption_exit", "fault_resume", "output_disk",
              "world_size", "refusals", "preflight_launch", "hub_cache"),
    "reporting": ("console", "export_check", "metrics", "reporting", "samples_chat", "summary", "vision_samples",
                  "smollm2", "mlflow_status", "replies", "benchmark_scores", "tracking_server"),
    "entry": ("config", "recipes", "readme_commands", "notebooks", "python_api", "parameters_file",
              "workload_check", "workload_global_batch", "workload_runs", "suite_layout", "one_process_api",
              "new_workload", "script_exit"),
}
AREA_OF_FILE = {f"test_{name}.py": area for area, names in AREAS.items() for name in names}


def pytest_configure(config):
    for area in AREAS:
        config.addinivalue_line("markers", f"{area}: the {area} area's tests (docs/testing.md)")
    # `make test-area AREA=dat` would otherwise select no test and say only "45 deselected"
    selected = config.option.markexpr
    if selected.isidentifier() and selected not in (*AREAS, "fsdp", "slow"):
        raise pytest.UsageError(f"-m {selected} selects no test: AREA= is one of {', '.join(AREAS)}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in AREA_OF_FILE:  # a file in no area fails tests/test_suite_layout.py
            item.add_marker(getattr(pytest.mark, AREA_OF_FILE[item.path.name]))


# ── The inner loop's guard: a test that takes more than ~10 s carries `slow` or `fsdp`, or `make test-fast` carries
# it (docs/testing.md). Durations are reported, never asserted: the list is printed at the end of every run. ──
INNER_LOOP_SECONDS = 10.0
_unmarked_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if not ({"slow", "fsdp"} & set(report.keywords)):
        _unmarked_seconds[report.nodeid] = _unmarked_seconds.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    over = sorted(((seconds, nodeid) for nodeid, seconds in _unmarked_seconds.items() if seconds > INNER_LOOP_SECONDS),
                  reverse=True)
    if over:
        # a worker's first script run also starts the warm launcher (~15 s): that test is listed, and is not slow
        terminalreporter.section(f"over {INNER_LOOP_SECONDS:.0f} s without a slow or fsdp marker (make test-fast runs "
                                 "them; a worker's first script run includes the warm launcher's start)")
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:6.1f}s {nodeid}")
