"""Every benchmark script runs end to end in its --quick mode, and what it reports holds together.

The numbers of a quick run mean nothing; these tests keep the scripts from rotting and check the
facts a report states that do not depend on speed (labels equal to the reference method's,
tokens conserved, the kernel comparison passing).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_quick(capsys, script: str, *args: str) -> str:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        assert importlib.import_module(script).main(["--quick", *args]) == 0
    finally:
        sys.path.remove(str(BENCHMARKS))
    return capsys.readouterr().out


def table_rows(report: str, first_header: str) -> list[dict[str, str]]:
    """The rows of every markdown table in ``report`` whose first column is ``first_header``."""
    rows, headers = [], None
    for line in report.splitlines():
        if not line.startswith("|"):
            headers = None
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if headers is None:
            headers = cells if cells[0] == first_header else []
        elif headers and not set(cells[0]) <= {"-", " "}:
            rows.append(dict(zip(headers, cells)))
    return rows


def number(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("%xk"))


@pytest.mark.slow
def test_data_prep_quick_labels_match_the_seed_method(capsys):
    report = run_quick(capsys, "data_prep")

    checks = [row for row in table_rows(report, "template") if "same masks" in row]
    assert [row["template"] for row in checks] == ["llama3.1"]
    same, total = checks[0]["same masks"].split("/")
    assert same == total and int(total) > 0
    blocks_same, blocks = checks[0]["same blocks"].split("/")
    assert blocks_same == blocks and int(blocks) > 0

    methods = {row["method"]: row for row in table_rows(report, "method")}
    assert set(methods) == {"`seed`", "`trl`", "`ours`", "`ours:masking`", "`limit`", "`tokenizer only`"}
    assert methods["`trl`"]["assistant-only labels"] == "no: refused"  # TRL has no training copy of this template
    assert all(number(row["tokens/s"]) > 0 for row in methods.values())
    two_workers = [row for row in table_rows(report, "template") if "method" in row]
    assert {row["method"] for row in two_workers} == {"`trl x2`", "`ours x2`"}


def test_packing_efficiency_quick_conserves_tokens(capsys):
    report = run_quick(capsys, "packing_efficiency")
    rows = table_rows(report, "strategy")
    ours_split = [row for row in rows if row["strategy"] == "ours, `pack_blocks` split at block edges"]
    assert len(ours_split) == 3  # alpaca at 1024, UltraChat-like at the quick block, and resampled to a rank's share
    for row in ours_split:
        assert row["tokens lost"] == "0"
        # Splitting at block edges leaves only the last block partly empty.
        block = number(row["token slots"]) / number(row["rows"])
        assert number(row["token slots"]) - number(row["real tokens"]) < block
    arrival = [row for row in rows if "arrival order" in row["strategy"]]
    best_fit = [row for row in rows if "best fit over" in row["strategy"]]
    assert len(arrival) == len(best_fit) == 3
    for plain, windowed in zip(arrival, best_fit):
        assert windowed["tokens lost"] == plain["tokens lost"] and number(windowed["rows"]) <= number(plain["rows"])
    seed001 = [row for row in rows if row["strategy"].startswith("seed 001")]
    assert seed001 and number(seed001[0]["tokens lost"]) > 0  # the seed never yields its last partial block
    for row in rows:
        if "padding-free" in row["strategy"]:
            assert row["token slots"] == row["real tokens"] and row["efficiency"] == "100.00%"


def test_train_throughput_cpu_quick_trains_every_strategy(capsys):
    report = run_quick(capsys, "train_throughput_cpu")
    rows = {row["strategy"]: row for row in table_rows(report, "strategy")}
    assert len(rows) == 4
    for row in rows.values():
        assert number(row["real tokens/s"]) > 0 and number(row["steps"]) > 0
    packed = rows["TRL packing='bfd' (padding-free)"]
    assert packed["real / slots"] == "100.0%"
    padded = rows["seed 000: pad every row to max_length"]
    assert number(rows["ours: pack_blocks + BlockDiagonalCollator"]["token slots"]) < number(padded["token slots"])


@pytest.mark.fsdp
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_gpu_script_quick_on_cpu(capsys):
    report = run_quick(capsys, "gpu_throughput", "--device", "cpu")
    runs = table_rows(report, "batches")
    plain = [row for row in runs if row["kernels"] == "plain"]
    assert [row["batches"] for row in plain] == ["padded", "packed"]
    assert all(number(row["real tokens/s"]) > 0 for row in plain)
    assert plain[1]["real / slots"] == "100.0%"  # only full blocks are timed
    comparisons = table_rows(report, "comparison")
    assert len(comparisons) == 4 and all(row["result"] == "pass" for row in comparisons)
    sp_rows = {row["SP size"]: row for row in table_rows(report, "SP size")}
    assert set(sp_rows) == {"1", "2"}  # --quick on CPU: gloo, two processes at most
    assert all(number(row["block tokens/s (group)"]) > 0 for row in sp_rows.values())
    # the same first block and weights: SP 2's loss is SP 1's (the global token mean over the group)
    assert abs(number(sp_rows["2"]["first loss"]) - number(sp_rows["1"]["first loss"])) < 1e-3


def test_gpu_script_sequence_parallel_arguments():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        gpu = importlib.import_module("gpu_throughput")
    finally:
        sys.path.remove(str(BENCHMARKS))

    assert gpu.parse_args([]).sequence_parallel == (1, 2, 4)
    assert gpu.parse_args(["--sequence-parallel", "2,8", "--sp-block", "65536"]).sequence_parallel == (2, 8)
    assert gpu.parse_args(["--sequence-parallel", ""]).sequence_parallel == ()  # section skipped
    assert gpu.parse_args(["--quick"]).sp_block == 512
    with pytest.raises(SystemExit):
        gpu.parse_args(["--sequence-parallel", "2,x"])
    with pytest.raises(SystemExit):
        gpu.parse_args(["--sequence-parallel", "0"])
    needs_more = gpu.sequence_parallel_size_skip_reason(4, 32768, "cuda", devices=1)
    assert needs_more == "skipped: needs 4 GPUs, this machine has 1"
    assert gpu.sequence_parallel_size_skip_reason(4, 32768, "cuda", devices=8) is None
    assert gpu.sequence_parallel_size_skip_reason(3, 32768, "cpu", devices=0).startswith("skipped: the 32768-token")


def test_planner_vs_published_sets_our_estimates_beside_their_measurements(capsys):
    report = run_quick(capsys, "planner_vs_published")
    rows = table_rows(report, "setup")
    assert [row["published (their measurement)"] for row in rows[:2]] == ["5,762 tokens/s/GPU", "6,667 tokens/s/GPU"]
    speedup = next(row for row in rows if row["setup"] == "HSDP / FSDP speed-up")
    assert speedup["published (their measurement)"] == "1.34x" and float(speedup["planner estimate (ours)"][:-1]) > 1
    assert "nothing here was measured by this project" in report


def test_image_packing_efficiency_quick_conserves_tokens(capsys):
    report = run_quick(capsys, "image_packing_efficiency")
    rows = {row["strategy"]: row for row in table_rows(report, "strategy")}
    assert len({row["real tokens"] for row in rows.values()}) == 1  # every strategy trains the same tokens
    padded = rows["one example per row, padded to max_length"]
    best_fit = rows["ours, whole examples, best-fit 1024"]
    arrival = rows["ours, whole examples, arrival order"]
    assert number(best_fit["rows"]) <= number(arrival["rows"]) < number(padded["rows"])
    assert number(best_fit["padding share"]) < number(padded["padding share"])
