"""The suite's own layout: every test file in one area, and the warm launcher's runs as the real launcher's."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest
from conftest import AREAS, CPU_CONFIG, REPO_ROOT, TINY_LLAMA_RECIPE, bin_path, free_port, run_command
from warm_launcher import import_time_environment
from worker_processes import PRELOADED


def test_every_test_file_is_in_exactly_one_area():
    files = sorted(path.name for path in (REPO_ROOT / "tests").glob("test_*.py"))
    listed = Counter(f"test_{name}.py" for names in AREAS.values() for name in names)
    assert [name for name in files if listed[name] != 1] == []
    assert sorted(listed) == files  # and no area names a file that is gone


def test_an_area_that_does_not_exist_is_refused_not_an_empty_run():
    """`make test-area AREA=dat` (pytest -m dat) ran no test and said only "deselected"."""
    from conftest import pytest_configure

    def configured(marker_expression: str):
        return SimpleNamespace(option=SimpleNamespace(markexpr=marker_expression), addinivalue_line=lambda *_: None)

    with pytest.raises(pytest.UsageError, match=f"^-m dat selects no test: AREA= is one of {', '.join(AREAS)}$"):
        pytest_configure(configured("dat"))
    for accepted in ("data", "fsdp", "not fsdp and not slow", ""):
        pytest_configure(configured(accepted))


def test_every_module_the_worker_server_preloads_exists():
    """multiprocessing's forkserver skips a preloaded name that does not import, without a word: a misspelt one would
    only make every gloo worker test import it again (tests/worker_processes.py)."""
    import importlib.util

    assert [name for name in PRELOADED if importlib.util.find_spec(name) is None] == []


def test_a_variable_read_at_import_time_sends_the_run_to_the_real_launcher():
    assert import_time_environment({"HF_HUB_OFFLINE": "1", "HF_TOKEN": "x", "MLFLOW_RUN_ID": "r", "OMP_NUM_THREADS": "1"}) \
        == {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _dump_environment(tmp_path, launcher: str) -> dict[str, dict[str, str]]:
    out = tmp_path / launcher
    out.mkdir()
    dump = tmp_path / "dump_env.py"
    dump.write_text("import json, os, sys\n"
                    "open(os.path.join(sys.argv[1], 'env' + os.environ['RANK'] + '.json'), 'w')"
                    ".write(json.dumps(dict(os.environ)))\n")
    result = run_command([bin_path("accelerate"), "launch", "--config_file", str(CPU_CONFIG), "--num_processes", "2",
                          "--main_process_port", str(free_port()), str(dump), str(out)], timeout=120, launcher=launcher)
    assert result.returncode == 0, result.stderr[-3000:]
    return {rank: json.loads((out / f"env{rank}.json").read_text()) for rank in ("0", "1")}


# What differs by nature between two launches (ports, pids) or is torchrun's bookkeeping of its own agent.
LAUNCH_SPECIFIC = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "_"}


@pytest.mark.fsdp
def test_the_warm_launcher_gives_each_rank_the_environment_accelerate_launch_gives(tmp_path):
    real, warm = _dump_environment(tmp_path, "real"), _dump_environment(tmp_path, "warm")
    for rank in ("0", "1"):
        missing = {name: real[rank][name] for name in set(real[rank]) - set(warm[rank]) - LAUNCH_SPECIFIC}
        extra = {name: warm[rank][name] for name in set(warm[rank]) - set(real[rank]) - LAUNCH_SPECIFIC}
        different = {name: (real[rank][name], warm[rank][name]) for name in set(real[rank]) & set(warm[rank])
                     if real[rank][name] != warm[rank][name] and name not in LAUNCH_SPECIFIC}
        assert (missing, extra, different) == ({}, {}, {}), rank


@pytest.mark.fsdp
def test_a_refusal_reaches_the_test_as_it_does_through_torchrun(tmp_path):
    """One `error:` line, every rank's exit code 2 in the failure report, the launch's exit code 1, on both."""
    results = {}
    for launcher in ("real", "warm"):
        cmd = [bin_path("accelerate"), "launch", "--config_file", str(CPU_CONFIG), "--num_processes", "2",
               "--main_process_port", str(free_port()), "scripts/sft.py", str(TINY_LLAMA_RECIPE),
               "--output_dir", str(tmp_path / launcher), "--max_steps", "-3"]
        results[launcher] = run_command(cmd, launcher=launcher)
    for launcher, result in results.items():
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert (result.returncode, len(errors)) == (1, 1), (launcher, result.stderr[-3000:])
        assert result.stderr.count("exitcode  : 2") == 2, (launcher, result.stderr[-3000:])
