#!/usr/bin/env python3
"""Seconds from `accelerate launch` to the first logged step of the tiny Llama twin (2 CPU processes), best of N.

    .venv/bin/python benchmarks/startup_time.py                       # this checkout, best of 5
    .venv/bin/python benchmarks/startup_time.py --repo ../other-clone   # another checkout (its own .venv), e.g. before

Each launch is `make demo`'s command with `--max_steps 2 --report_to none` into a fresh output_dir; the clock
stops when the console prints `step 1/` and again when the launcher exits.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment_header, markdown_table  # noqa: E402


def one_launch(repo: Path, output_dir: Path) -> tuple[float, float]:
    command = [str(repo / ".venv" / "bin" / "accelerate"), "launch", "--config_file", "accelerate_configs/fsdp2_cpu.yaml",
               "scripts/sft.py", "recipes/tiny/llama8b.yaml", "--max_steps", "2", "--report_to", "none",
               "--output_dir", str(output_dir)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    first_step = None
    with subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True) as launch:
        for line in launch.stdout:
            if first_step is None and line.startswith("step 1/"):
                first_step = time.perf_counter() - start
    assert launch.returncode == 0 and first_step is not None, f"{command} failed ({launch.returncode})"
    return first_step, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    repo = args.repo.resolve()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True).stdout
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for attempt in range(args.repeats):
            runs.append(one_launch(repo, Path(scratch) / f"run{attempt}"))
    first, whole = [run[0] for run in runs], [run[1] for run in runs]
    print(environment_header(f"Start-up: accelerate launch -> first logged step ({repo.name} at {commit.strip()})"))
    print(markdown_table(["", "best (s)", "median (s)", "all (s)"],
                         [["to step 1", f"{min(first):.1f}", f"{statistics.median(first):.1f}",
                           ", ".join(f"{value:.1f}" for value in first)],
                          ["whole launch (2 steps, export)", f"{min(whole):.1f}", f"{statistics.median(whole):.1f}",
                           ", ".join(f"{value:.1f}" for value in whole)]]))


if __name__ == "__main__":
    main()
