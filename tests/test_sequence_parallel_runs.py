"""Sequence parallelism in real runs: `accelerate launch` with 4 CPU processes as two groups of two
(`--sequence_parallel_size 2`) training like one process, for the tiny Llama, Qwen3.5 and gpt-oss twins.

The two groups read two packed-block streams (one reader each); one process with two dataloader
workers reads the same two, in the same order (see sft_recipes.fault.world_size), with the same
global batch, so its losses are the reference, step for step. Two groups, because a collective
that is right only for the group holding ranks 0..N-1 passes with one. The Llama case is also
preempted (SIGTERM to rank 1) and resumed on one 2-rank group: its later losses are the
one-process run's too.
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
import yaml

from conftest import REPO_ROOT, assert_resume_reproduces, launch_sft, read_summary
from fault_helpers import complete, finish, start_run, wait_for, worker_pid

TINY = REPO_ROOT / "recipes" / "tiny"
PACKED_CHAT = ("--dataset_name", "data/samples/ultrachat.jsonl", "--dataset_format", "messages",
               "--pack_blocks", "true")


STEPS = ("--max_steps", "3", "--logging_steps", "1", "--report_to", "none", "--save_steps", "1000")


def _launch_pair(tmp_path, recipe, global_batch, *overrides):
    """The recipe on 1 process with two readers, and on 2 groups of 2 processes sharing each block:
    (their summaries, the SP run's output)."""
    one, shared = tmp_path / "one", tmp_path / "sp2"
    settings = yaml.safe_load(recipe.read_text())
    settings.pop("gradient_accumulation_steps", None)  # derived from the global batch on each world size
    recipe = tmp_path / f"global_batch_{recipe.name}"
    recipe.write_text(yaml.safe_dump({**settings, "global_batch_size": global_batch}))
    launch_sft(recipe, *overrides, *STEPS, "--dataloader_num_workers", "2", "--output_dir", str(one), nproc=1)
    result = launch_sft(recipe, *overrides, *STEPS, "--dataloader_num_workers", "0",
                        "--sequence_parallel_size", "2", "--output_dir", str(shared), nproc=4)
    return read_summary(one), read_summary(shared), result.stdout + result.stderr


def assert_same_losses(reference: dict[str, float], losses: dict[str, float]) -> None:
    assert losses and set(losses) <= set(reference)
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], abs=1e-4), step


# The Llama and gpt-oss twins packed on chat data; the Qwen3.5 twin is packed already (with its vision
# tower: its output head is sharded with the text decoder's final norm, see sft_recipes.fsdp_wrap).
# (max_length, global batch: 2 per_device_train_batch_size, one per group, overrides).
TWINS = {"llama8b": (256, 8, PACKED_CHAT), "gptoss120b": (512, 4, PACKED_CHAT), "qwen27b": (256, 2, ())}


@pytest.mark.fsdp
@pytest.mark.parametrize("twin", TWINS)
def test_two_groups_of_two_ranks_sharing_each_block_train_like_one_process(tmp_path, twin):
    max_length, global_batch, overrides = TWINS[twin]
    one, shared, output = _launch_pair(tmp_path, TINY / f"{twin}.yaml", global_batch, *overrides)
    assert "2 sequence-parallel groups (4 processes / sequence_parallel_size 2)" in output
    for rank in range(4):
        group, half = divmod(rank, 2)
        tokens = f"{half * max_length // 2}-{(half + 1) * max_length // 2 - 1}"
        assert f"rank {rank} holds tokens {tokens} of each {max_length}-token block of reader {group} of 2" in output
    assert list(shared["losses"]) == ["1", "2", "3"]
    assert_same_losses(one["losses"], shared["losses"])
    assert shared["tokens_seen"] == one["tokens_seen"] > 0  # each shared block counted once, not once per rank


PREEMPTED = re.compile(r"\[preempted\] stopped at step (\d+) of 6")


@pytest.mark.fsdp
def test_preempted_run_under_sequence_parallelism_resumes_exactly(tmp_path):
    """Llama packed on chat data: first losses and, after a SIGTERM and a resume, the later ones equal one
    process's."""
    llama = TINY / "llama8b.yaml"
    common = (*PACKED_CHAT, "--max_steps", "6", "--logging_steps", "1", "--report_to", "none", "--save_steps", "3")
    reference = tmp_path / "one"
    launch_sft(llama, *common, "--output_dir", str(reference), nproc=1)
    out = tmp_path / "sp2"
    sp_run = (*common, "--sequence_parallel_size", "2", "--output_dir", str(out))
    run = start_run(*sp_run, recipe=llama, env={"FAULT_SLOW_STEP_SECONDS": "0.5"})
    wait_for(lambda: complete(out / "checkpoint-3"), run, "the first checkpoint")
    os.kill(worker_pid(run, 1), signal.SIGTERM)
    preempted = finish(run).output
    match = PREEMPTED.search(preempted)
    assert match, preempted[-4000:]
    stop = int(match.group(1))
    assert 3 <= stop < 6
    state = json.loads((out / f"checkpoint-{stop}" / "trainer_state.json").read_text())
    before = {str(entry["step"]): entry["loss"] for entry in state["log_history"] if "loss" in entry}
    assert list(before)[:3] == ["1", "2", "3"]
    assert_same_losses(read_summary(reference)["losses"], before)
    launch_sft(llama, *sp_run)
    assert_resume_reproduces(reference, out, stop, atol=1e-4)


@pytest.mark.fsdp
def test_a_packed_mixture_with_held_out_eval_trains_and_evaluates_like_one_process(tmp_path):
    """gpt-oss twin, a reasoning and a chat source packed together, 10% held out: two SP 2 groups log one
    process's losses and eval loss (each rank evaluates its own eval rows whole), and the report counts each source."""
    recipe = yaml.safe_load((TINY / "gptoss120b.yaml").read_text())
    del recipe["dataset_name"]
    recipe.update(datasets=[{"path": "data/samples/multilingual_thinking.jsonl", "dataset_format": "reasoning",
                             "fraction": 0.5},
                            {"path": "data/samples/ultrachat.jsonl", "dataset_format": "messages", "fraction": 0.5}],
                  test_split_size=0.1, pack_blocks=True, eval_strategy="steps", eval_steps=3)
    path = tmp_path / "mixture.yaml"
    path.write_text(yaml.safe_dump(recipe))
    one, shared, _ = _launch_pair(tmp_path, path, 4)
    assert_same_losses(one["losses"], shared["losses"])
    assert one["eval_loss"] > 0 and shared["eval_loss"] == pytest.approx(one["eval_loss"], abs=1e-4)
    for run in ("one", "sp2"):
        sources = json.loads((tmp_path / run / "data_report.json").read_text())["sources"]
        assert [source["eval_rows"] > 0 and source["supervised_tokens"] > 0 for source in sources] == [True, True]
