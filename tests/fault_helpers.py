"""Start a 2-process CPU run with injected faults, find its workers, and watch them (for test_fault_*)."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from conftest import CPU_CONFIG, REPO_ROOT, TINY_LLAMA_RECIPE, bin_path, free_port, log_launch, run_command

FAULT_LAUNCHER = REPO_ROOT / "tests" / "fault_injection.py"
RUN_TIMEOUT = 240


class Run:
    """A launched run whose output is drained in the background (a full pipe would block the workers)."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.cmd, self.started = cmd, time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.pid = self.proc.pid
        self._lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self._lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self._lines)

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        self.proc.kill()

    def wait(self) -> int:
        self.proc.wait()
        self._reader.join()
        if self.started is not None:
            log_launch("real", self.cmd, self.started)
            self.started = None
        return self.proc.returncode


def start_run(*overrides: str, env: dict[str, str] | None = None, recipe: Path = TINY_LLAMA_RECIPE,
              script: Path = FAULT_LAUNCHER, config: Path = CPU_CONFIG, nproc: int = 2) -> Run:
    """`accelerate launch` of `script` (tests/fault_injection.py by default) on 2 CPU processes (`config`, `nproc`:
    another layout, e.g. HSDP's 4)."""
    cmd = [bin_path("accelerate"), "launch", "--config_file", str(config), "--num_processes", str(nproc),
           "--main_process_port", str(free_port()), str(script), str(recipe), *overrides]
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                **(env or {})}
    return Run(cmd, full_env)


def launch_with_faults(*overrides: str, env: dict[str, str] | None = None, recipe: Path = TINY_LLAMA_RECIPE,
                       config: Path = CPU_CONFIG, nproc: int = 2) -> subprocess.CompletedProcess:
    """`accelerate launch` of tests/fault_injection.py to the end, for a run that nothing signals or stops from
    outside (its faults and probes come from `env`): through `run_command`, so the warm launcher (docs/testing.md)."""
    return run_command([bin_path("accelerate"), "launch", "--config_file", str(config), "--num_processes", str(nproc),
                        "--main_process_port", str(free_port()), str(FAULT_LAUNCHER), str(recipe), *overrides], env)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def worker_pid(launcher: Run, rank: int) -> int | None:
    """The pid of the training process of `rank` under the launcher, None while it does not exist."""
    pending = _children(launcher.pid)
    while pending:
        pid = pending.pop()
        pending += _children(pid)
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and any(item.startswith(b"LOCAL_RANK=") for item in environ):
            return pid
    return None


def process_state(pid: int) -> str | None:
    """The one-letter state of `pid` (R, S, T, Z...), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def wait_for(condition, launcher: Run, what: str, timeout: float = RUN_TIMEOUT) -> None:
    """Poll `condition()` until true; fail early if the launcher exits first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if launcher.poll() is not None:
            raise AssertionError(f"run ended (rc {launcher.poll()}) before {what}:\n{launcher.output[-5000:]}")
        if time.monotonic() > deadline:
            launcher.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def complete(checkpoint_dir: Path) -> bool:
    return (checkpoint_dir / "checkpoint_complete.json").is_file()


@dataclass
class Finished:
    returncode: int
    output: str
    gone_at: dict[int, float] = field(default_factory=dict)  # rank -> monotonic time its process ended


def finish(launcher: Run, watch_ranks: tuple[int, ...] = ()) -> Finished:
    """Wait for the launcher; with `watch_ranks`, record when each of those workers ended."""
    pids: dict[int, int] = {}
    gone_at: dict[int, float] = {}
    deadline = time.monotonic() + RUN_TIMEOUT
    while launcher.poll() is None and time.monotonic() < deadline:
        for rank in watch_ranks:
            if rank not in pids and (pid := worker_pid(launcher, rank)) is not None:
                pids[rank] = pid
            if rank in pids and rank not in gone_at and process_state(pids[rank]) in (None, "Z"):
                gone_at[rank] = time.monotonic()
        time.sleep(0.05)
    if launcher.poll() is None:
        launcher.kill()
    returncode = launcher.wait()
    for rank in watch_ranks:
        gone_at.setdefault(rank, time.monotonic())
    return Finished(returncode, launcher.output, gone_at)


# torchrun's failure report: one block per failed rank, "rank : R (local_rank: R)" then "exitcode : C".
_RANK_EXIT = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def rank_exit_codes(launcher_output: str) -> dict[int, int]:
    """Each failed rank's own exit code, as torchrun reports it."""
    return {int(rank): int(code) for rank, code in _RANK_EXIT.findall(launcher_output)}
