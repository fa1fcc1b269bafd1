"""Several passes over packed data in real runs (tiny Llama twin, FSDP2 on CPU): the step count known before training,
exact resume mid-pass and at a pass boundary, and a stream read once that ends before max_steps and says so."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import (
    CPU_CONFIG, HSDP_CPU_CONFIG, REPO_ROOT, TINY_LLAMA_RECIPE, assert_resume_reproduces, launch_sft, read_summary,
)

pytestmark = pytest.mark.fsdp

ROWS = 24  # alpaca rows as chat: 3 steps a pass on 2 processes x 1 block x 2 accumulation steps


def packed(data, output_dir, *overrides):
    return ("--dataset_name", str(data), "--dataset_format", "alpaca_chat", "--pack_blocks", "true",
            "--completion_only_loss", "null", "--per_device_train_batch_size", "1", "--sample_prompts", "[]",
            "--report_to", "none", "--logging_steps", "1", "--output_dir", str(output_dir), *overrides)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "alpaca.jsonl"
    with open(REPO_ROOT / "data" / "samples" / "alpaca.jsonl") as rows:
        path.write_text("".join(next(rows) for _ in range(ROWS)))
    return path


@pytest.mark.parametrize("nproc, config", [(2, CPU_CONFIG), (4, HSDP_CPU_CONFIG)], ids=["flat2", "hsdp2x2"])
def test_two_passes_over_packed_rows_plan_their_steps_and_resume_exactly_mid_pass_and_at_the_boundary(
        tmp_path, data, nproc, config):
    full = tmp_path / "full"
    epochs = ("--max_steps", "-1", "--num_train_epochs", "2", "--save_steps", "1")
    result = launch_sft(TINY_LLAMA_RECIPE, *packed(data, full, *epochs), nproc=nproc, config=config)
    summary = read_summary(full)
    per_pass = summary["packed_passes"]["steps_per_pass"]
    assert per_pass >= 2 and summary["packed_passes"]["passes"] == 2
    # Known before training: the schedule, the step lines and the ETA count every step of both passes.
    assert summary["steps"] == summary["max_steps"] == 2 * per_pass
    assert f"{2 * per_pass} steps = 2 pass(es)" in result.stdout
    assert f"step 1/{2 * per_pass} " in result.stdout + result.stderr
    assert summary["data_ended_before_max_steps"] is None
    # Mid-pass on flat FSDP, and at the boundary on both layouts: the next pass's order comes back too.
    for step in ([1, per_pass] if nproc == 2 else [per_pass]):
        resumed = tmp_path / f"resumed-{step}"
        resumed.mkdir()
        shutil.copytree(full / f"checkpoint-{step}", resumed / f"checkpoint-{step}")
        launch_sft(TINY_LLAMA_RECIPE, *packed(data, resumed, *epochs), nproc=nproc, config=config)
        assert_resume_reproduces(full, resumed, step, atol=1e-4)


def test_max_steps_trains_on_through_further_passes(tmp_path, data):
    out = tmp_path / "run"
    launch_sft(TINY_LLAMA_RECIPE, *packed(data, out, "--max_steps", "7", "--save_steps", "100"))
    summary = read_summary(out)
    assert summary["steps"] == summary["max_steps"] == 7 and summary["packed_passes"]["steps_per_pass"] < 7


def test_a_stream_read_once_ends_before_max_steps_says_so_and_a_rerun_names_the_cause(tmp_path, data):
    out = tmp_path / "run"
    streamed = ("--dataset_streaming", "true", "--save_steps", "100")
    result = launch_sft(TINY_LLAMA_RECIPE, *packed(data, out, "--max_steps", "30", *streamed))
    summary = read_summary(out)
    ended = [line for line in result.stdout.splitlines() if line.startswith("[data] the packed stream ended")]
    assert ended == [f"[data] the packed stream ended at step {summary['steps']} of max_steps 30: one pass over the "
                     "streamed data, the run ends here. A stream is read once; to train several passes pass "
                     "--max_steps -1 --num_train_epochs N (the stream is then counted before training, every pass in "
                     "a new order)."]
    assert summary["data_ended_before_max_steps"] == ended[0] and summary["max_steps"] == 30
    assert f"[train] {summary['steps']} steps of max_steps 30 (the packed stream ended)" in result.stdout
    state = json.loads((out / f"checkpoint-{summary['steps']}" / "trainer_state.json").read_text())
    assert state["stateful_callbacks"]["StopWhenAnyRankExhausted"]["attributes"]["data_ended_at_step"] == \
        summary["steps"]

    again = launch_sft(TINY_LLAMA_RECIPE, *packed(data, out, "--max_steps", "30", *streamed))
    assert "ended where its packed stream ended" in again.stdout and "nothing to learn" not in again.stdout + again.stderr
    assert read_summary(out) == summary  # nothing written

    # Asked for passes, the stream is counted first and read twice, each time to the counted step.
    twice = tmp_path / "twice"
    launch_sft(TINY_LLAMA_RECIPE, *packed(data, twice, "--max_steps", "-1", "--num_train_epochs", "2", *streamed))
    passes = read_summary(twice)
    assert passes["steps"] == 2 * passes["packed_passes"]["steps_per_pass"] and passes["steps"] >= summary["steps"]
