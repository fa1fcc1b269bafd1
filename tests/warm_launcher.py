"""Test-only warm launcher: `accelerate launch` and `python SCRIPT` runs forked from a pre-imported parent.

A cold 2-process launch of the tiny twin spends ~15 s before its first step, most of it importing torch,
transformers, TRL, accelerate and the package (in the launcher, then in every rank); the suite makes about a
hundred launches. This server imports all of that once and forks each run from it:

    tests/warm_launcher.py SOCKET     serve: import, then one launch per connection, in order

A launch request names the script, its arguments, the environment, the working directory and either an
accelerate config or --multi_gpu + process count (a launch) or neither (one plain process). For a launch the server forks a
supervisor that plays torchrun's elastic agent, as `accelerate launch` would run it:
  - the environment comes from accelerate itself (`launch_command_parser`, `_validate_launch_command`,
    `prepare_multi_gpu_env`: the config's ACCELERATE_*/FSDP_*/PARALLELISM_CONFIG_* variables), plus what
    torchrun's agent gives each worker (RANK, LOCAL_RANK, WORLD_SIZE, ..., TORCHELASTIC_USE_AGENT_STORE=True);
  - the supervisor serves the agent's TCPStore at MASTER_ADDR:MASTER_PORT (the refusal count of
    sft_recipes.refusal_exit meets there, as under torchrun);
  - it polls the workers every 0.1 s; once one exits non-zero it SIGTERMs the rest, SIGKILLs what is left
    after 30 s (torchrun's defaults), and prints torchrun's failure report lines (`rank : R (local_rank: R)` /
    `exitcode  : C`) to stderr; the launch's exit code is 1 then, as `accelerate launch`'s is.
Each worker is a fork that sets that environment, the working directory and stdout/stderr (shared by all
ranks, unbuffered like torchrun's `python -u`), then runs the script as `__main__` and exits as Python would
(non-daemon threads joined, atexit handlers run).

What stays on the real launchers is listed in docs/testing.md; tests/conftest.py decides per call
(`launch_sft(..., launcher="real")`), and falls back to the real one when the environment differs from the
server's in a variable that libraries read at import time.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

POLL_SECONDS = 0.1  # torchrun's --monitor_interval default
STOP_GRACE_SECONDS = 30  # torchrun's wait between SIGTERM and SIGKILL when it stops the other workers
# Read once at import by torch, transformers, huggingface_hub, tokenizers or Python itself: a run whose
# environment differs from the server's in one of these cannot be forked from it.
IMPORT_TIME_PREFIXES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "TOKENIZERS_", "OMP_",
                        "MKL_", "PYTHON", "CUDA_", "TRITON_", "FLA_", "XDG_", "LD_", "MPLBACKEND", "MALLOC_")
RUNTIME_ONLY = {"HF_TOKEN", "HF_TOKEN_PATH", "PYTHONUNBUFFERED"}


def import_time_environment(env: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items()
            if name.startswith(IMPORT_TIME_PREFIXES) and name not in RUNTIME_ONLY}


# ── server ─────────────────────────────────────────────────────────────────────────────────────────────────────

def preload() -> None:
    """What every run imports, in the order scripts/sft.py imports it (runtime defaults first)."""
    from sft_recipes.environment import set_runtime_defaults

    set_runtime_defaults()
    import accelerate.commands.launch  # noqa: F401  the launch's own environment code
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401
    import mlflow  # noqa: F401
    # What an MLflow run imports at its first call (its sqlite store: sqlalchemy, alembic; git for the source tags):
    # ~0.9 s on rank 0 of every such run otherwise
    import git  # noqa: F401
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
    import peft  # noqa: F401
    import torch.distributed.run  # noqa: F401
    import trl  # noqa: F401
    import sft_recipes.config  # noqa: F401
    import sft_recipes.run  # noqa: F401
    import sft_recipes.python_api  # noqa: F401
    # The product imports it for qwen3_5 models only (with fla, ~4 s): the qwen3_5 runs fork with it imported, the
    # kernels it bound are put back by the packing fixes or model loading in the worker, as in a real run
    import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401
    from sft_recipes.planner.dry_run import plan_dry_run  # noqa: F401


def serve(socket_path: str) -> None:
    preload()
    import gc

    gc.collect()
    gc.freeze()  # the preloaded objects stay out of every fork's collections: fewer copied pages
    assert threading.active_count() == 1, f"a preloaded module started threads: {threading.enumerate()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(1)
    print("ready", flush=True)
    while True:
        connection, _ = listener.accept()
        with connection, connection.makefile("rw") as stream:
            request = json.loads(stream.readline())
            sys.stdout.flush(), sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the supervisor: never returns into this loop
                listener.close()
                code = 1
                try:
                    os.setpgid(0, 0)  # the client kills this group (supervisor and workers) on a timeout
                    code = supervise(request)
                finally:
                    os._exit(code)
            try:
                stream.write(json.dumps({"pgid": pid}) + "\n")
                stream.flush()
                _, status = os.waitpid(pid, 0)
                stream.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
                stream.flush()
            except OSError:  # the client gave up (its timeout killed the run): serve the next one
                pass


def supervise(request: dict) -> int:
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    out = os.open(request["stdout"], os.O_WRONLY | os.O_APPEND)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_APPEND)
    if request.get("config") is None and not request.get("multi_gpu"):  # one plain process: `python SCRIPT ARGS`
        worker = fork_worker(request, {}, out, err)
        _, status = os.waitpid(worker, 0)
        return os.waitstatus_to_exitcode(status)
    env = launch_environment(request)
    world_size = int(request["nproc"])
    workers = {rank: fork_worker(request, {**env, **rank_environment(env, rank, world_size)}, out, err)
               for rank in range(world_size)}
    import torch.distributed as dist

    # After the forks: a store serves from a thread, and workers are forked from a parent without threads.
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=True,  # noqa: F841
                          wait_for_workers=False)
    return monitor(workers, request["script"], err)


def launch_environment(request: dict) -> dict[str, str]:
    """The environment `accelerate launch --config_file C (or --multi_gpu) --num_processes N --main_process_port P`
    gives torchrun."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    how = ["--config_file", request["config"]] if request.get("config") else ["--multi_gpu"]
    args = launch_command_parser().parse_args(
        [*how, "--num_processes", str(request["nproc"]),
         "--main_process_port", str(request["port"]), request["script"], *request["args"]])
    args, _, _ = _validate_launch_command(args)
    assert args.use_fsdp or args.multi_gpu, f"{how}: the warm launcher plays torchrun only"
    env = prepare_multi_gpu_env(args)
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env["MASTER_PORT"] = str(request["port"])
    return env


def rank_environment(env: dict[str, str], rank: int, world_size: int) -> dict[str, str]:
    """What torchrun's agent adds for each worker of a one-node launch."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(world_size), "WORLD_SIZE": str(world_size),
            "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(world_size), "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            # set in the agent's own environment by torch.distributed.launcher.api.launch_agent, so inherited
            "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT"}


def fork_worker(request: dict, rank_env: dict[str, str], out: int, err: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:
        os.environ.update(rank_env)
        os.dup2(out, 1)
        os.dup2(err, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        sys.stdout.reconfigure(line_buffering=True, write_through=True)  # torchrun runs `python -u`
        sys.stderr.reconfigure(line_buffering=True, write_through=True)
        run_script(request["script"], request["args"])
    finally:
        os._exit(1)  # only if the worker's own set-up failed: run_script ends the process itself


def run_script(script: str, args: list[str]) -> NoReturn:
    """`python SCRIPT ARGS` in this process, exiting as the interpreter would (less its teardown, as a clean end of
    scripts/sft.py does: the fork's copy of the server's objects is never collected either way)."""
    import random
    import runpy

    from sft_recipes.script_exit import exit_like_the_interpreter

    random.seed()  # a fresh process seeds `random` from the OS; forks share the parent's state
    sys.argv = [script, *args]
    sys.path[0] = str(Path(script).resolve().parent)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_like_the_interpreter(code)


def monitor(workers: dict[int, int], script: str, err: int) -> int:
    """torchrun's agent loop: wait for every worker; on the first failure stop the others, then report."""
    codes: dict[int, int] = {}
    failed_at: float | None = None
    while len(codes) < len(workers):
        time.sleep(POLL_SECONDS)
        for rank, pid in workers.items():
            if rank not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(status)
        if failed_at is None and any(code != 0 for code in codes.values()):
            failed_at = time.monotonic()
            for rank, pid in workers.items():
                if rank not in codes:
                    os.kill(pid, signal.SIGTERM)
        if failed_at is not None and time.monotonic() - failed_at > STOP_GRACE_SECONDS:
            for rank, pid in workers.items():
                if rank not in codes:
                    os.kill(pid, signal.SIGKILL)
    failures = {rank: code for rank, code in sorted(codes.items()) if code != 0}
    if not failures:
        return 0
    report = ["torch.distributed.elastic.multiprocessing.errors.ChildFailedError: (warm launcher)", "=" * 60,
              f"{script} FAILED", "-" * 60, "Failures:"]
    for index, (rank, code) in enumerate(failures.items()):
        report += [f"[{index}]:", f"  rank      : {rank} (local_rank: {rank})", f"  exitcode  : {code} (pid: {workers[rank]})"]
    os.write(err, ("\n".join(report) + "\n" + "=" * 60 + "\n").encode())
    return 1


# ── client ─────────────────────────────────────────────────────────────────────────────────────────────────────

class WarmLauncher:
    """One server per pytest session, started on first use; runs are served one at a time."""

    def __init__(self, repo_root: Path, env: dict[str, str], workdir: Path) -> None:
        self.repo_root, self.env, self.workdir = repo_root, env, workdir
        self.socket_path = str(workdir / "warm.sock")
        self.server: subprocess.Popen | None = None
        self.runs = 0

    def serves(self, env: dict[str, str]) -> bool:
        return import_time_environment(env) == import_time_environment(self.env)

    def start(self) -> None:
        self.server = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), self.socket_path],
                                       cwd=self.repo_root, env=self.env, stdout=subprocess.PIPE, text=True)
        ready = self.server.stdout.readline().strip()
        assert ready == "ready", f"the warm launcher did not start ({self.server.poll()}): {ready!r}"
        atexit.register(self.stop)

    def stop(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.kill()
            self.server.wait()

    def run(self, script: str, args: list[str], env: dict[str, str], timeout: float, config: str | None = None,
            nproc: int = 1, port: int = 0, multi_gpu: bool = False) -> subprocess.CompletedProcess:
        if self.server is None or self.server.poll() is not None:
            self.start()
        self.runs += 1
        out, err = self.workdir / f"run{self.runs}.out", self.workdir / f"run{self.runs}.err"
        out.write_text(""), err.write_text("")
        request = {"script": script, "args": args, "env": env, "cwd": str(self.repo_root), "config": config,
                   "multi_gpu": multi_gpu, "nproc": nproc, "port": port, "stdout": str(out), "stderr": str(err)}
        how = ["--config_file", config] if config else ["--multi_gpu"]
        command = ["(warm)", *(["accelerate", "launch", *how, "--num_processes", str(nproc)]
                               if config or multi_gpu else ["python"]), script, *args]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect(self.socket_path)
            connection.settimeout(timeout)
            stream = connection.makefile("rw")
            stream.write(json.dumps(request) + "\n")
            stream.flush()
            pgid = json.loads(stream.readline())["pgid"]
            try:
                returncode = json.loads(stream.readline())["returncode"]
            except (socket.timeout, TimeoutError):
                os.killpg(pgid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text()) from None
        result = subprocess.CompletedProcess(command, returncode, out.read_text(), err.read_text())
        out.unlink(), err.unlink()
        return result


if __name__ == "__main__":
    serve(sys.argv[1])
