"""What every benchmark report shares: the machine and versions it ran on, timing, memory, tables."""

from __future__ import annotations

import datetime
import os
import platform
import resource
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any, TypeVar

T = TypeVar("T")

# Before any benchmark pins itself to fewer CPUs.
NPROC_AT_START = len(os.sched_getaffinity(0))
PACKAGES = ("torch", "transformers", "trl", "tokenizers", "datasets", "accelerate")
# One core, one thread: the Rust tokenizer's rayon pool, torch's and BLAS's pools.
SINGLE_THREAD_ENV = {
    "RAYON_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def environment_header(title: str, argv: Sequence[str] | None = None) -> str:
    """Markdown lines naming the date, machine, versions and the exact command of this run."""
    argv = sys.argv if argv is None else argv
    command = " ".join(shlex.quote(arg) for arg in ["python", os.path.relpath(argv[0]), *argv[1:]])
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    return "\n".join([
        f"### {title}",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- machine: nproc {NPROC_AT_START}, {cpu_model()}; load average at start {load} "
        "(the machine is shared: other jobs run beside the benchmark)",
        "- versions: " + ", ".join(f"{name} {version}" for name, version in versions().items()),
        f"- command: `{command}`",
        "",
    ])


_scratch: list[tempfile.TemporaryDirectory] = []


def scratch_dir() -> str:
    """A directory for trainers' ``output_dir`` (nothing is saved there), removed when the process exits."""
    if not _scratch:
        _scratch.append(tempfile.TemporaryDirectory(prefix="bench-"))
    return _scratch[0].name


def pin_to_cpus(cpus: set[int]) -> None:
    """Run this process on ``cpus`` only (what ``taskset -c`` does); cores that do not exist are skipped."""
    available = os.sched_getaffinity(0)
    chosen = cpus & available or {min(available)}
    os.sched_setaffinity(0, chosen)


def best_time(function: Callable[[], T], repeats: int) -> tuple[float, T]:
    """The fastest of ``repeats`` runs (the least disturbed by other load) and the last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - start)
    return best, result


def peak_rss_mib() -> float:
    """Highest resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    with open("/proc/self/statm", encoding="utf-8") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)
