"""Guards that keep a 2-process CPU run (FSDP2 over gloo) honest: non-finite steps, hung ranks, uneven shards."""

from __future__ import annotations

import json
import os
import re
import signal
import tempfile
import time

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import REPO_ROOT
from fault_helpers import finish, launch_with_faults, process_state, rank_exit_codes, start_run, wait_for, worker_pid

pytestmark = pytest.mark.fsdp


def load_dcp(directory) -> dict[str, object]:
    """A DCP checkpoint folder as one flat {key path: value} dict."""
    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(directory, f"{scratch}/state.pt")
        state = torch.load(f"{scratch}/state.pt", weights_only=False)

    def flat(value, prefix=""):
        if isinstance(value, dict):
            for key, item in value.items():
                yield from flat(item, f"{prefix}/{key}")
        else:
            yield prefix, value

    return dict(flat(state))


def worker_pid_when_started(run, rank: int) -> int:
    wait_for(lambda: worker_pid(run, rank) is not None, run, f"rank {rank} to start")
    return worker_pid(run, rank)


def test_nonfinite_steps_are_skipped_and_three_in_a_row_stop_with_a_checkpoint(tmp_path):
    out = tmp_path / "nan"
    # Rank 1 alone produces NaN losses: the gradient reduction spreads them, every rank skips.
    run = start_run("--max_steps", "8", "--save_steps", "4", "--max_nonfinite_steps_in_a_row", "3",
                    "--output_dir", str(out), "--report_to", "none", env={"FAULT_NAN_AT": "1:3,5,6,7"})
    result = finish(run)
    assert result.returncode != 0
    skipped = [int(step) for step in re.findall(r"step (\d+): gradient norm is nan: update skipped", result.output)]
    assert skipped == [3, 5, 6, 7]
    assert "(1 in a row, 2 in total" in result.output  # step 4 was finite: the count in a row restarted
    assert "error: stopped at step 7: 3 optimizer steps in a row had a non-finite gradient norm" in result.output
    # every rank exits 1 on its own: torchrun stopped none first (rank 0 killed before its line was out: -15)
    assert rank_exit_codes(result.output) == {0: 1, 1: 1}, result.output[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-7"]
    # Steps 5-7 changed nothing: no update, no weight decay, no Adam state, so checkpoint-7 == checkpoint-4.
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        at_4, at_7 = load_dcp(out / "checkpoint-4" / part), load_dcp(out / "checkpoint-7" / part)
        assert at_4.keys() == at_7.keys() and at_4
        for key, value in at_4.items():
            assert torch.equal(value, at_7[key]) if torch.is_tensor(value) else value == at_7[key], key
    # ...and step 3 was skipped too: Adam took 3 steps by step 4, not 4.
    adam_steps = {float(value) for key, value in at_4.items() if key.endswith("/step")}
    assert adam_steps == {3.0}


def test_a_hung_rank_makes_the_other_fail_within_ddp_timeout(tmp_path):
    timeout = 10
    run = start_run("--max_steps", "8", "--ddp_timeout", str(timeout), "--output_dir", str(tmp_path / "hang"),
                    "--report_to", "none", env={"FAULT_HANG_AT": "1:3"})
    rank_1 = worker_pid_when_started(run, 1)
    wait_for(lambda: process_state(rank_1) == "T", run, "rank 1 to hang")
    hung_at = time.monotonic()
    rank_0 = worker_pid(run, 0)
    wait_for(lambda: process_state(rank_0) in (None, "Z"), run, "rank 0 to give up", timeout=timeout + 60)
    waited = time.monotonic() - hung_at
    os.kill(rank_1, signal.SIGKILL)  # torchrun would, 30 s after rank 0 failed
    result = finish(run)
    assert timeout - 1 <= waited <= timeout + 15, waited
    assert f"Timed out waiting {timeout * 1000}ms" in result.output
    assert result.returncode != 0


def test_uneven_shards_end_every_pass_on_the_same_step(tmp_path):
    """dispatch_batches: false gives each rank its own files; rank 1's has 8 rows (one step), rank 0's 40."""
    shards = tmp_path / "shards"
    shards.mkdir()
    rows = (REPO_ROOT / "data" / "samples" / "alpaca.jsonl").read_text().splitlines()
    (shards / "train-00000.jsonl").write_text("\n".join(rows[:40]) + "\n")
    (shards / "train-00001.jsonl").write_text("\n".join(rows[40:48]) + "\n")
    result = launch_with_faults("--max_steps", "4", "--dataset_name", str(shards), "--dataset_streaming", "true",
                                "--accelerator_config", json.dumps({"dispatch_batches": False}), "--save_steps", "100",
                                "--output_dir", str(tmp_path / "uneven"), "--report_to", "none",
                                env={"FAULT_END_TOGETHER": "1"})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    taken = {rank: [(int(step), int(n)) for step, n in
                    re.findall(rf"BATCHES rank={rank} step=(\d+) n=(\d+)", output)] for rank in (0, 1)}
    # Both ranks take the same number of batches at every call: same collectives, same step.
    assert taken[0] == taken[1]
    # Step 1 uses rank 1's whole shard (8 rows = 2 batches of 4); then the pass is over for both ranks
    # (empty calls until the epoch ends), and the next pass starts on both at step 2.
    assert taken[1][0] == (1, 2)
    assert taken[1][1] == (2, 0)
    assert [n for step, n in taken[1] if n] == [2, 2, 2, 2]
