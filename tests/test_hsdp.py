"""HSDP on the CPU test bed: 4 processes as 2 replicas x 2 shards (accelerate_configs/hsdp_cpu.yaml), FSDP2 over gloo.

One module-scoped set of runs of the tiny Llama twin (global batch 16 sequences, fixed) feeds every test:
HSDP 2 x 2 for 4 steps (every rank then saves what it holds of each parameter), flat FSDP over 4, one
process, and the HSDP run preempted after checkpoint-2 resumed on HSDP, on flat FSDP over 2 and on one process.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import HSDP_CPU_CONFIG, TINY_LLAMA_RECIPE, assert_resume_reproduces, launch_sft, read_summary
from fault_helpers import finish, launch_with_faults, process_state, start_run, wait_for, worker_pid

pytestmark = pytest.mark.fsdp

STEPS, SAVE_AT = 4, 2
COMMON = ["--max_steps", str(STEPS), "--save_steps", str(SAVE_AT), "--report_to", "none"]
GLOBAL_BATCH = ("--global_batch_size", "16")  # over the twin's fixed accumulation: 1 on 4 processes, 2 on 2, 4 on 1
HSDP_LAYOUT = "HSDP 2 replicas x 2 shards (dp_replicate x dp_shard) over 4 processes"


def preempted_copy(full, to) -> None:
    """`full` as a run preempted after checkpoint-SAVE_AT left it: the final checkpoint and export never written."""
    to.mkdir()
    shutil.copytree(full / f"checkpoint-{SAVE_AT}", to / f"checkpoint-{SAVE_AT}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hsdp")
    common = (*COMMON, *GLOBAL_BATCH)
    # Through the warm launcher: the real `accelerate launch` of HSDP 2 x 2 is the killed and hung runs' below
    hsdp = launch_with_faults(*common, "--output_dir", str(root / "hsdp"), env={"PROBE_LOCAL_SHARDS": str(root / "shards")},
                              config=HSDP_CPU_CONFIG, nproc=4)
    hsdp_output = hsdp.stdout + hsdp.stderr
    assert hsdp.returncode == 0, hsdp_output[-6000:]
    launch_sft(TINY_LLAMA_RECIPE, *common, "--output_dir", str(root / "flat4"), nproc=4)
    # 2 per device x 4 processes x 2 accumulation steps = 16: the all-reduce across replicas waits for the last
    launch_sft(TINY_LLAMA_RECIPE, *common, "--output_dir", str(root / "hsdp_accumulated"),
               "--per_device_train_batch_size", "2", nproc=4, config=HSDP_CPU_CONFIG)
    launch_sft(TINY_LLAMA_RECIPE, *common, "--output_dir", str(root / "one"), nproc=1)

    for layout in ("on_hsdp", "on_flat2", "on_one"):
        preempted_copy(root / "hsdp", root / layout)
    resumed = {"on_hsdp": launch_sft(TINY_LLAMA_RECIPE, *common, "--output_dir", str(root / "on_hsdp"), nproc=4,
                                     config=HSDP_CPU_CONFIG),
               "on_flat2": launch_sft(TINY_LLAMA_RECIPE, *common, "--output_dir", str(root / "on_flat2"), nproc=2)}
    launch_sft(TINY_LLAMA_RECIPE, *common, "--output_dir", str(root / "on_one"), nproc=1)
    return {"root": root, "hsdp_output": hsdp_output,
            "resume_logs": {layout: result.stdout + result.stderr for layout, result in resumed.items()}}


def test_the_run_is_hsdp_and_logs_its_mesh(runs):
    summary = read_summary(runs["root"] / "hsdp")
    assert summary["distributed"] == f"FSDP2 {HSDP_LAYOUT} on cpu"  # the mesh, not only the process count
    output = runs["hsdp_output"]
    assert f"global batch 16 sequences = 4 per device x 4 processes x 1 accumulation steps (derived); {HSDP_LAYOUT}" \
        in output
    assert (f"[mesh] {HSDP_LAYOUT} (replica 0: ranks 0-1; replica 1: ranks 2-3); every parameter Shard(0) over the 2 "
            "processes of its replica, Replicate() across the 2 replicas") in output


def test_every_parameter_is_split_two_ways_inside_a_replica_and_the_replicas_are_identical(runs):
    held = [torch.load(runs["root"] / "shards" / f"rank{rank}.pt") for rank in range(4)]
    exported = AutoModelForCausalLM.from_pretrained(runs["root"] / "hsdp").state_dict()
    assert held[0].keys() and all(h.keys() == held[0].keys() for h in held)
    for name in held[0]:
        for rank in range(4):
            assert held[rank][name]["mesh"] == (2, 2), name
            assert held[rank][name]["placements"] == ["Replicate()", "Shard(dim=0)"], name
        # Ranks 0, 1 are replica 0 and ranks 2, 3 replica 1 (row-major mesh); a shard is half of dim 0.
        for shard in (0, 1):
            assert torch.equal(held[shard][name]["local"], held[2 + shard][name]["local"]), name
        whole = torch.cat([held[0][name]["local"], held[1][name]["local"]])
        full_name = name.replace("._checkpoint_wrapped_module", "")
        assert held[0][name]["local"].shape[0] == whole.shape[0] // 2, name
        assert torch.equal(whole, exported[full_name]), name


def test_losses_and_grad_norms_equal_flat_fsdp_and_one_process(runs):
    hsdp, flat, one, accumulated = (read_summary(runs["root"] / name)
                                    for name in ("hsdp", "flat4", "one", "hsdp_accumulated"))
    assert flat["distributed"] == "FSDP2 over 4 process(es) on cpu"
    assert one["distributed"] == "FSDP2 over 1 process(es) on cpu"
    assert list(hsdp["losses"]) == list(hsdp["grad_norms"]) == [str(step) for step in range(1, STEPS + 1)]
    for other in (flat, one, accumulated):
        for step in hsdp["losses"]:
            assert hsdp["losses"][step] == pytest.approx(other["losses"][step], abs=1e-4), step
            assert hsdp["grad_norms"][step] == pytest.approx(other["grad_norms"][step], rel=1e-4), step
    # Every step was clipped (max_grad_norm 1.0): the equal later losses show it was clipped by the same norm.
    assert min(hsdp["grad_norms"].values()) > 1.0


def probe_logits(path, input_ids):
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def test_the_export_from_hsdp_reloads_with_the_trained_logits(runs):
    hsdp = runs["root"] / "hsdp"
    assert read_summary(hsdp)["export_max_logit_diff"] <= 1e-4  # in-run check against the sharded model
    probe = torch.tensor([[0, 20, 31, 47, 5, 99, 120, 7, 64, 3]])
    assert torch.allclose(probe_logits(hsdp, probe), probe_logits(runs["root"] / "one", probe), atol=1e-4)


@pytest.mark.parametrize("layout, world_size", [("on_hsdp", 4), ("on_flat2", 2), ("on_one", 1)])
def test_a_preempted_hsdp_run_resumes_exactly_on_every_layout(runs, layout, world_size):
    assert_resume_reproduces(runs["root"] / "hsdp", runs["root"] / layout, SAVE_AT, atol=1e-4)
    summary = read_summary(runs["root"] / layout)
    assert summary["world_size"] == world_size and summary["world_size_at_checkpoint"] == 4


def test_a_resume_on_another_mesh_says_so(runs):
    logs = runs["resume_logs"]
    assert f"written on {HSDP_LAYOUT}, on FSDP 1 x 2 (flat) over 2 processes: model and optimizer state are " \
           "resharded (DCP)" in logs["on_flat2"]
    assert "resharded" not in logs["on_hsdp"]  # the same mesh: nothing to say


# ── The fault guards under HSDP: a dead or hung rank ends every rank, in either replica ───────────────────────


def test_a_rank_killed_in_the_other_replica_ends_every_rank_without_a_timeout(tmp_path):
    out = tmp_path / "killed"
    run = start_run("--max_steps", "4", "--save_steps", "2", "--output_dir", str(out), "--report_to", "none",
                    config=HSDP_CPU_CONFIG, nproc=4, env={"FAULT_KILL_IN_SAVE": "2:2"})  # rank 2: replica 1
    result = finish(run, watch_ranks=(0, 1, 2, 3))
    assert result.returncode != 0
    assert f"[mesh] {HSDP_LAYOUT} (replica 0: ranks 0-1; replica 1: ranks 2-3)" in result.output  # the real launch's mesh
    assert not (out / "checkpoint-2" / "checkpoint_complete.json").exists()
    # The survivors did not wait for a collective timeout (ddp_timeout: 1800 s by default).
    assert max(result.gone_at.values()) - result.gone_at[2] < 60, result.output[-3000:]


def test_a_hung_rank_makes_every_other_rank_fail_within_bounded_time(tmp_path):
    """Rank 3 (replica 1) stops at step 2. Its shard partner (rank 2) and its replica partner (rank 1) wait on it in
    a collective and time out after ddp_timeout; a failed rank makes torchrun stop the rest, each wait bounded by
    ddp_timeout again. Every rank ends, within a few ddp_timeouts (measured under load: see the message)."""
    timeout = 10
    run = start_run("--max_steps", "4", "--ddp_timeout", str(timeout), "--output_dir", str(tmp_path / "hang"),
                    "--report_to", "none", config=HSDP_CPU_CONFIG, nproc=4, env={"FAULT_HANG_AT": "3:2"})
    wait_for(lambda: worker_pid(run, 3) is not None, run, "rank 3 to start")
    hung = worker_pid(run, 3)
    wait_for(lambda: process_state(hung) == "T", run, "rank 3 to hang")
    hung_at = time.monotonic()
    others = {rank: worker_pid(run, rank) for rank in (0, 1, 2)}
    ended: dict[int, float] = {}
    while len(ended) < len(others) and time.monotonic() - hung_at < 6 * timeout + 60:
        for rank, pid in others.items():
            if rank not in ended and process_state(pid) in (None, "Z"):
                ended[rank] = round(time.monotonic() - hung_at, 1)
        time.sleep(0.05)
    # torchrun kills it 30 s after the first rank failed; under load that can come before the loop above ends.
    with contextlib.suppress(ProcessLookupError):
        os.kill(hung, signal.SIGKILL)
    result = finish(run)
    (tmp_path / "hang.log").write_text(result.output)
    assert sorted(ended) == [0, 1, 2], (ended, result.output[-3000:])
    assert min(ended.values()) <= timeout + 15, ended  # the first collective timeout, as on 2 processes
    assert max(ended.values()) <= 4 * timeout + 20, ended
    assert f"Timed out waiting {timeout * 1000}ms" in result.output
    assert result.returncode != 0
