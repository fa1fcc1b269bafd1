#!/usr/bin/env python3
"""Seconds from `accelerate launch` to the first logged step of the tiny Llama twin (2 CPU processes), best of N;
and what the whole launch took, in wall-clock seconds and in CPU seconds summed over the launcher and its ranks.

    .venv/bin/python benchmarks/startup_time.py                       # this checkout, best of 5
    .venv/bin/python benchmarks/startup_time.py --repo ../other-clone   # another checkout (its own .venv), e.g. before
    .venv/bin/python benchmarks/startup_time.py --floor                 # also: what the imports alone cost
    .venv/bin/python benchmarks/startup_time.py --teardown              # also: what a process's end costs

Each launch is `make demo`'s command with `--max_steps 2 --report_to none` into a fresh output_dir; the clock
stops when the console prints `step 1/` and again when the launcher exits. The CPU seconds are the launch's
processes' user + system time (`RUSAGE_CHILDREN`: the launcher waits for its ranks, so theirs are counted in it).

`--floor` times, in fresh interpreters of the same venv, the imports a launch cannot do without: the launcher's
(before it starts any rank) and one rank's (the libraries a full fine-tune of the Llama twin uses, with and without
peft, then with scripts/sft.py's own). The launcher's plus one rank's is the least any launch of this structure can
take before its first step, whatever our code does.

`--teardown` times, in fresh interpreters, the CPU seconds from the end of a script that made a rank's imports
(`sft_recipes.run`'s) to the end of its process: through the interpreter's finalization, and through
`sft_recipes.script_exit` (what scripts/sft.py does at a clean end).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment_header, markdown_table  # noqa: E402


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_launch(repo: Path, output_dir: Path) -> tuple[float, float, float]:
    command = [str(repo / ".venv" / "bin" / "accelerate"), "launch", "--config_file", "accelerate_configs/fsdp2_cpu.yaml",
               "scripts/sft.py", "recipes/tiny/llama8b.yaml", "--max_steps", "2", "--report_to", "none",
               "--output_dir", str(output_dir)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start, cpu_before = time.perf_counter(), children_cpu_seconds()
    first_step = None
    with subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True) as launch:
        for line in launch.stdout:
            if first_step is None and line.startswith("step 1/"):
                first_step = time.perf_counter() - start
    assert launch.returncode == 0 and first_step is not None, f"{command} failed ({launch.returncode})"
    return first_step, time.perf_counter() - start, children_cpu_seconds() - cpu_before


# A rank of a full fine-tune needs these whatever our code does: FSDP2, the model's modeling module, TRL's trainer,
# datasets. transformers and TRL import peft whenever it is installed (transformers.trainer_utils, TRL's
# sft_trainer); hiding it from their availability check measures what "peft only for LoRA" could save.
RANK_LIBRARIES = ("import torch.distributed.fsdp, datasets; from transformers.models.llama import modeling_llama; "
                  "from trl import SFTTrainer")
HIDE_PEFT = ("import transformers.utils.import_utils as availability; seen = availability._is_package_available; "
             "availability._is_package_available = lambda name, *a, **k: (False, 'N/A') if name == 'peft' "
             "else seen(name, *a, **k); ")
FLOOR_IMPORTS = (
    ("the interpreter alone", "pass"),
    ("`accelerate launch`'s CLI (`accelerate.commands.accelerate_cli`: every subcommand)",
     "import accelerate.commands.accelerate_cli"),
    ("accelerate's launch command alone (`accelerate.commands.launch`, the `accelerate-launch` entry point)",
     "import accelerate.commands.launch"),
    ("a rank's libraries: FSDP2, transformers' Llama, TRL's SFTTrainer, datasets (peft comes with them)",
     RANK_LIBRARIES),
    ("the same with peft hidden from transformers and TRL", HIDE_PEFT + RANK_LIBRARIES),
    ("a rank's imports as scripts/sft.py makes them (the libraries + sft_recipes)",
     "import scripts.sft; " + RANK_LIBRARIES),
)


def import_seconds(repo: Path, code: str) -> float:
    start = time.perf_counter()
    subprocess.run([str(repo / ".venv" / "bin" / "python"), "-c", code], cwd=repo, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


RANK_IMPORTS = ("import time; from sft_recipes.environment import set_runtime_defaults; set_runtime_defaults(); "
                "import sft_recipes.run; print(time.process_time(), flush=True)")
TEARDOWNS = (
    ("the interpreter's exit (finalization)", RANK_IMPORTS),
    ("`sft_recipes.script_exit` (threads, atexit, flush, `os._exit`)",
     RANK_IMPORTS + "; from sft_recipes.script_exit import exit_like_the_interpreter; exit_like_the_interpreter(0)"),
)


def teardown_seconds(repo: Path, code: str) -> float:
    """CPU seconds the process spent after the script's last line: its whole CPU time less what it had used then."""
    before = children_cpu_seconds()
    done = subprocess.run([str(repo / ".venv" / "bin" / "python"), "-c", code], cwd=repo, check=True,
                          capture_output=True, text=True)
    return children_cpu_seconds() - before - float(done.stdout.split()[-1])


def best_median_all_table(headers: list[str], cases, measure, repo: Path, repeats: int) -> str:
    """One row per (what, code) case: `measure(repo, code)` taken `repeats` times, its best, median and every value."""
    rows = []
    for what, code in cases:
        seconds = [measure(repo, code) for _ in range(repeats)]
        rows.append([what, f"{min(seconds):.2f}", f"{statistics.median(seconds):.2f}",
                     ", ".join(f"{value:.2f}" for value in seconds)])
    return markdown_table(headers, rows)


def teardown_table(repo: Path, repeats: int) -> str:
    return best_median_all_table(["a rank's imports, then the end of the process", "best CPU (s)", "median CPU (s)",
                                  "all (s)"], TEARDOWNS, teardown_seconds, repo, repeats)


def floor_table(repo: Path, repeats: int) -> str:
    return best_median_all_table(["imports in a fresh interpreter", "best (s)", "median (s)", "all (s)"],
                                 FLOOR_IMPORTS, import_seconds, repo, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--floor", action="store_true", help="also time the imports a launch cannot do without")
    parser.add_argument("--teardown", action="store_true", help="also time a process's end after a rank's imports")
    args = parser.parse_args()
    repo = args.repo.resolve()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True).stdout
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for attempt in range(args.repeats):
            runs.append(one_launch(repo, Path(scratch) / f"run{attempt}"))
    first, whole, cpu = [run[0] for run in runs], [run[1] for run in runs], [run[2] for run in runs]
    print(environment_header(f"Start-up: accelerate launch -> first logged step ({repo.name} at {commit.strip()})"))
    print(markdown_table(["", "best (s)", "median (s)", "all (s)"],
                         [["to step 1", f"{min(first):.1f}", f"{statistics.median(first):.1f}",
                           ", ".join(f"{value:.1f}" for value in first)],
                          ["whole launch (2 steps, export)", f"{min(whole):.1f}", f"{statistics.median(whole):.1f}",
                           ", ".join(f"{value:.1f}" for value in whole)],
                          ["whole launch, CPU seconds of all its processes", f"{min(cpu):.1f}",
                           f"{statistics.median(cpu):.1f}", ", ".join(f"{value:.1f}" for value in cpu)]]))
    if args.floor:
        print()
        print(floor_table(repo, args.repeats))
    if args.teardown:
        print()
        print(teardown_table(repo, args.repeats))


if __name__ == "__main__":
    main()
