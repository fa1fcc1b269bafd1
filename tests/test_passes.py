"""Several passes over packed data: each pass's order, its blocks and steps counted before training, the loader's
length the Trainer plans with, and what a run whose stream ended early leaves for the next one."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from datasets import Dataset, load_dataset

from sft_recipes.data.blocks import RankLocalBlockStream, fill_blocks, pass_order
from sft_recipes.data.passes import (
    count_blocks, first_short_micro_batch, plan_passes, reader_row_lengths, steps_in_pass,
)
from sft_recipes.fault.resume import nothing_left_to_train
from sft_recipes.reporting.export_check import ExportCheck
from sft_recipes.reporting.summary import RunSummaryCallback
from sft_recipes.tiny import build_tokenizer
from sft_recipes.trainer import BlockLoader


def test_pass_zero_keeps_the_data_order_and_later_passes_draw_one_from_seed_pass_and_reader():
    rows = list(range(10))
    assert list(pass_order(rows, seed=0, epoch=0, reader=0)) == rows
    first = list(pass_order(rows, seed=0, epoch=1, reader=0))
    # A literal order: the draws are seeded by a string hashed with SHA-512, the same in every process and run.
    assert first == [7, 1, 2, 8, 9, 4, 0, 5, 6, 3]
    assert sorted(first) == rows
    assert list(pass_order(rows, seed=0, epoch=1, reader=0)) == first
    others = [list(pass_order(rows, seed=0, epoch=2, reader=0)), list(pass_order(rows, seed=1, epoch=1, reader=0)),
              list(pass_order(rows, seed=0, epoch=1, reader=1))]
    assert all(sorted(other) == rows and other != first for other in others)


def test_a_shard_larger_than_the_buffer_is_shuffled_over_the_buffer():
    rows = list(range(50))
    order = list(pass_order(rows, seed=0, epoch=1, reader=0, buffer=8))
    assert sorted(order) == rows and order != rows
    # a row comes out at most `buffer` places before its place in the data
    assert all(position >= row - 8 for position, row in enumerate(order))


@pytest.mark.parametrize("split_examples", [True, False])
def test_blocks_counted_from_lengths_are_the_blocks_the_stream_packs(split_examples):
    lengths = [3, 5, 2, 7, 1, 4, 4, 6, 2, 2, 9]
    examples = [{"input_ids": list(range(n)), "labels": list(range(n))} for n in lengths]
    for max_length in (4, 5, 8):
        packed = list(fill_blocks(examples, max_length, split_examples, window=3))
        assert count_blocks(lengths, max_length, split_examples, window=3) == len(packed)
    assert count_blocks([3, 5, 2], 4, True, 1) == 3 and count_blocks([3, 5, 2], 5, False, 1024) == 2


def test_a_pass_lasts_through_the_step_of_the_first_micro_batch_a_reader_cannot_fill():
    # 2 readers (2 ranks), 1 block per micro-batch, 2 accumulation steps: 4 micro-batches a step.
    # Reader 0 has 5 blocks: its 6th micro-batch (global number 5 * 2 + 0 = 10) is its first empty one.
    assert first_short_micro_batch(blocks=5, reader=0, readers=2, batch_size=1) == 10
    assert first_short_micro_batch(blocks=7, reader=1, readers=2, batch_size=1) == 15
    assert steps_in_pass(10, micro_batches_per_step=4) == 3  # micro-batches 8-11: its step, the last of the pass
    # Reader 0 with 4 blocks: micro-batch 8 opens step 3 empty, so the pass is steps 1-2 (the stream's own stop, one
    # step later, trained that step with no block of reader 0's).
    assert steps_in_pass(first_short_micro_batch(4, 0, 2, 1), 4) == 2
    # 2 blocks a micro-batch: 5 blocks fill 2 micro-batches, the 3rd is short (1 block): global number 4.
    assert first_short_micro_batch(blocks=5, reader=0, readers=2, batch_size=2) == 4
    assert steps_in_pass(0, 4) == 0


def conversations(n):
    return [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"answer number {i}" + " and more" * (i % 4)}]}
            for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("qwen3_5")


def real_blocks(stream):
    blocks = []
    for block in stream:
        if block["stream_exhausted"]:
            return blocks
        blocks.append(block)


def questions_in(tokenizer, blocks) -> list[int]:
    text = tokenizer.decode([token for block in blocks for token in block["input_ids"]])
    return [int(number) for number in re.findall(r"question (\d+)<", text)]


@pytest.mark.parametrize("streamed", [False, True], ids=["map-style", "streamed-jsonl"])
def test_each_pass_reads_the_whole_shard_again_in_its_own_order(tokenizer, tmp_path, streamed):
    rows = conversations(12) + [{"messages": [{"role": "user", "content": "no reply"}]}]  # dropped every pass
    if streamed:
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        data = load_dataset("json", data_files=str(path), split="train", streaming=True)
    else:
        data = Dataset.from_list(rows)
    stream = RankLocalBlockStream(data, tokenizer, max_length=48, rank=0, world_size=1, split_examples=False, seed=3)
    orders = []
    for epoch in range(3):
        stream.epoch = epoch
        orders.append(questions_in(tokenizer, real_blocks(stream)))
    assert orders[0] == list(range(12))
    assert all(sorted(order) == list(range(12)) for order in orders) and orders[1] != orders[0] != orders[2]
    # Counting sees every row's fate in the data's order: its example's length, or None (dropped).
    lengths = reader_row_lengths(stream, (0, 1))
    assert len(lengths) == 13 and lengths[-1] is None and None not in lengths[:12]


def test_the_plan_counts_every_pass_as_the_stream_packs_it(tokenizer):
    stream = RankLocalBlockStream(Dataset.from_list(conversations(30)), tokenizer, max_length=40, rank=0,
                                  world_size=1, split_examples=False, seed=0)
    blocks = []
    for epoch in range(3):
        stream.epoch = epoch
        blocks.append(len(real_blocks(stream)))
    # 1 process, 1 block per micro-batch, 2 accumulation steps: a pass is ceil(blocks / 2) steps, the fewest any pass
    # counted allows.
    passes = plan_passes(stream, batch_size=1, accumulation=2, workers=0, max_steps=-1, num_train_epochs=3,
                         timeout_seconds=60)
    assert passes.steps_per_pass == min(-(-count // 2) for count in blocks)
    assert (passes.max_steps, passes.passes, passes.counted_passes) == (3 * passes.steps_per_pass, 3, 3)
    assert stream.micro_batches_per_pass == 2 * passes.steps_per_pass
    assert len(BlockLoader(stream, batch_size=1)) == 2 * passes.steps_per_pass  # what the Trainer plans with
    # max_steps trains as many passes as it needs, as the Trainer does with map-style data
    by_steps = plan_passes(stream, batch_size=1, accumulation=2, workers=0, max_steps=2 * passes.steps_per_pass + 1,
                           num_train_epochs=1, timeout_seconds=60)
    assert (by_steps.max_steps, by_steps.counted_passes) == (2 * passes.steps_per_pass + 1, 3)
    assert "step(s) per pass" in by_steps.describe()
    half = plan_passes(stream, batch_size=1, accumulation=2, workers=0, max_steps=-1, num_train_epochs=0.5,
                       timeout_seconds=60)
    assert half.max_steps == -(-passes.steps_per_pass // 2)


def test_a_stream_read_once_has_no_length():
    stream = RankLocalBlockStream(Dataset.from_list(conversations(2)), SimpleNamespace(pad_token_id=0), 8, 0, 1)
    with pytest.raises(TypeError):
        len(BlockLoader(stream, batch_size=1))


def test_data_that_fills_no_step_is_refused_with_the_fix(tokenizer):
    stream = RankLocalBlockStream(Dataset.from_list(conversations(1)), tokenizer, max_length=64, rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"fills no optimizer step in pass 1: a reader has fewer than "
                                         r"per_device_train_batch_size \(2\) blocks.*Use more data"):
        plan_passes(stream, batch_size=2, accumulation=1, workers=0, max_steps=-1, num_train_epochs=1,
                    timeout_seconds=60)


def write_state(checkpoint, global_step, data_ended_at_step):
    checkpoint.mkdir()
    callbacks = {"StopWhenAnyRankExhausted": {"args": {}, "attributes": {"data_ended_at_step": data_ended_at_step}}}
    (checkpoint / "trainer_state.json").write_text(json.dumps(
        {"global_step": global_step, "max_steps": 6, "num_train_epochs": 1, "stateful_callbacks": callbacks}))


def test_a_rerun_after_the_stream_ended_names_the_cause_and_the_fix(tmp_path):
    write_state(tmp_path / "checkpoint-3", 3, data_ended_at_step=3)
    reason = nothing_left_to_train(str(tmp_path / "checkpoint-3"), SimpleNamespace(max_steps=6, num_train_epochs=3))
    assert reason == (f"{tmp_path}/checkpoint-3 ended where its packed stream ended, at step 3: the stream was read "
                      "once, so there is nothing left to read for max_steps 6; nothing written. To train several "
                      "passes over a stream pass --max_steps -1 --num_train_epochs N with --overwrite_output_dir true "
                      "(the stream is counted before training, every pass in a new order).")
    write_state(tmp_path / "checkpoint-2", 2, data_ended_at_step=None)  # stopped by max_steps 2, or preempted
    assert nothing_left_to_train(str(tmp_path / "checkpoint-2"), SimpleNamespace(max_steps=6)) is None


def test_run_summary_records_a_stream_that_ended_before_max_steps(tmp_path):
    summary = RunSummaryCallback()
    summary.max_steps, summary.data_ended = 6, "[data] the packed stream ended at step 3 of max_steps 6: ..."
    report = summary.finish(1.0, tmp_path, ExportCheck("skipped"), None, "FSDP2 over 2 process(es) on cpu")
    assert (report["max_steps"], report["data_ended_before_max_steps"]) == (6, summary.data_ended)
    report.update(steps=3, final_loss=5.0, seconds_per_step=0.5)
    assert RunSummaryCallback.closing_line(report).startswith(
        "[train] 3 steps of max_steps 6 (the packed stream ended) in 1.0s")
