"""`sft_recipes.script_exit.run_then_exit`: a script's process ends as the interpreter ends it, less its teardown.

Each case runs a small script in a fresh interpreter (no torch: ~0.1 s each). What the interpreter's own exit does
must still happen: non-daemon threads joined, an idle executor's worker stopped, atexit handlers run, stdout and
stderr flushed, the status passed on. What it does last, finalization, must not: an object alive at exit is not
collected (its `__del__` would print).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from functools import partial
    from sft_recipes.script_exit import run_then_exit

    class Finalized:
        def __del__(self):
            print("finalized", flush=True)

    alive_at_exit = Finalized()

    def late_thread():
        time.sleep(0.3)
        print("thread finished", flush=True)

    def main(how):
        threading.Thread(target=late_thread).start()
        ThreadPoolExecutor(1).submit(lambda: None).result()  # its worker waits idle for more work
        atexit.register(lambda: print("atexit ran", flush=True))
        sys.stdout.write("unflushed output")  # no newline, no flush: a pipe's buffer holds it
        sys.stderr.write("unflushed error")
        if how == "raise":
            raise RuntimeError("a bug")
        if how.startswith("exit "):
            sys.exit(int(how.split()[1]) if how.split()[1].isdigit() else how.split()[1])
        return int(how)

    run_then_exit(partial(main, sys.argv[1]))
""")


def run_script(tmp_path, how: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("how, code", [("0", 0), ("2", 2), ("exit 75", 75), ("exit 0", 0)])
def test_a_clean_end_runs_what_the_interpreter_runs_at_exit_but_not_its_teardown(tmp_path, how, code):
    result = run_script(tmp_path, how)
    assert result.returncode == code, result.stderr
    assert result.stdout.splitlines() == ["unflushed outputthread finished", "atexit ran"], result.stdout
    assert result.stderr == "unflushed error"  # flushed, and no "finalized" anywhere: the teardown was skipped
    assert "finalized" not in result.stdout


def test_an_uncaught_exception_or_an_exit_message_leaves_through_the_interpreter(tmp_path):
    crashed = run_script(tmp_path, "raise")
    assert crashed.returncode == 1
    assert crashed.stderr.startswith("unflushed errorTraceback (most recent call last):")
    assert crashed.stderr.rstrip().endswith("RuntimeError: a bug")
    assert crashed.stdout.splitlines() == ["unflushed outputthread finished", "atexit ran", "finalized"]

    message = run_script(tmp_path, "exit stopped")
    assert message.returncode == 1 and message.stderr == "unflushed errorstopped\n"
    assert message.stdout.splitlines() == ["unflushed outputthread finished", "atexit ran", "finalized"]


def test_every_script_that_loads_the_stack_ends_through_run_then_exit():
    """The scripts users run per command or per rank (training, scoring, chat, merge, show): each would otherwise pay
    ~1 s of teardown at its end (`make show`: 5.6 -> 4.6 s, benchmarks/startup_time_2026-12-06.md)."""
    import ast

    from conftest import REPO_ROOT

    ending = {}
    for name in ("sft.py", "evaluate.py", "chat.py", "merge_lora.py", "show_run.py"):
        tree = ast.parse((REPO_ROOT / "scripts" / name).read_text())
        main_block = next(node for node in tree.body
                          if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test))
        ending[name] = ast.unparse(main_block.body[-1])
    assert [name for name, line in ending.items() if not line.startswith("run_then_exit(")] == [], ending
