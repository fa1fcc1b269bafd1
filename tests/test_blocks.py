"""Packed block streams: literal tokens in, exact blocks out; disjoint rank shards; a shared stop."""

from __future__ import annotations

import json
import re

import pytest
import torch
from datasets import Dataset, load_dataset
from torch.utils.data import DataLoader

from sft_recipes.data.blocks import (
    RankLocalBlockStream, StopWhenAnyRankExhausted, StreamStats, collate_blocks, fill_blocks,
)
from sft_recipes.data.collator import BlockDiagonalCollator
from sft_recipes.tiny import build_tokenizer

EXAMPLES = [
    {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
    {"input_ids": [4, 5, 6, 7, 8], "labels": [-100, -100, 6, 7, 8]},
    {"input_ids": [9, 10], "labels": [9, 10]},
]


def test_split_examples_fills_every_block_like_the_seed():
    blocks = list(fill_blocks(EXAMPLES, max_length=4, split_examples=True))
    assert blocks == [
        {"input_ids": [1, 2, 3, 4], "labels": [-100, 2, 3, -100], "seq_lengths": [3, 1]},
        {"input_ids": [5, 6, 7, 8], "labels": [-100, 6, 7, 8], "seq_lengths": [4]},
        {"input_ids": [9, 10], "labels": [9, 10], "seq_lengths": [2]},
    ]


def test_whole_examples_start_a_new_block_and_long_ones_are_cut():
    blocks = list(fill_blocks(EXAMPLES, max_length=4, split_examples=False))
    assert blocks == [
        {"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "seq_lengths": [3]},
        {"input_ids": [4, 5, 6, 7], "labels": [-100, -100, 6, 7], "seq_lengths": [4]},
        {"input_ids": [9, 10], "labels": [9, 10], "seq_lengths": [2]},
    ]


def test_whole_examples_fill_each_block_best_fit_from_the_waiting_ones():
    # The oldest example opens the block; the longest waiting one that still fits fills it.
    assert list(fill_blocks(EXAMPLES, max_length=5, split_examples=False)) == [
        {"input_ids": [1, 2, 3, 9, 10], "labels": [-100, 2, 3, 9, 10], "seq_lengths": [3, 2]},
        {"input_ids": [4, 5, 6, 7, 8], "labels": [-100, -100, 6, 7, 8], "seq_lengths": [5]},
    ]
    # A window of one is arrival order: a block takes the next example while it fits.
    assert [b["seq_lengths"] for b in fill_blocks(EXAMPLES, max_length=5, split_examples=False, window=1)] == [
        [3], [5], [2]]
    assert [b["seq_lengths"] for b in fill_blocks(EXAMPLES[::-1], max_length=7, split_examples=False, window=1)] == [
        [2, 5], [3]]


def test_best_fit_takes_the_oldest_of_equally_long_examples():
    examples = [{"input_ids": ids, "labels": ids} for ids in ([1, 2], [3], [4], [5, 6, 7])]
    blocks = list(fill_blocks(examples, max_length=3, split_examples=False))
    assert [b["input_ids"] for b in blocks] == [[1, 2, 3], [4], [5, 6, 7]]


def test_whole_example_packing_needs_a_window():
    with pytest.raises(ValueError, match="packing_window must be at least 1"):
        list(fill_blocks(EXAMPLES, max_length=5, split_examples=False, window=0))


def test_collated_blocks_reset_positions_and_mask_segment_starts():
    collate = collate_blocks(BlockDiagonalCollator(max_length=4, pad_token_id=0))
    blocks = [{**b, "stream_exhausted": 0} for b in fill_blocks(EXAMPLES, max_length=4)]
    batch = collate(blocks)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 2, 3], [0, 1, 0, 1]]
    assert batch["seq_idx"].tolist() == [[0, 0, 0, 1], [2, 2, 2, 2], [3, 3, 4, 4]]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100], [-100, 6, 7, 8], [-100, 10, -100, -100]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 4, 8, 10, 12]
    assert batch["stream_exhausted"].item() == 0


def test_whole_example_blocks_keep_a_row_each_in_a_batch():
    # Two partial blocks in one step: each keeps its own row and its examples stay whole.
    collate = collate_blocks(BlockDiagonalCollator(max_length=5, pad_token_id=0, block_per_row=True))
    blocks = [{**b, "stream_exhausted": 0} for b in fill_blocks(EXAMPLES, max_length=5, split_examples=False, window=1)]
    assert [b["seq_lengths"] for b in blocks] == [[3], [5], [2]]
    batch = collate(blocks)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8], [9, 10, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4], [0, 1, 0, 1, 2]]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, -100], [-100, -100, 6, 7, 8], [-100, 10, -100, -100, -100]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 10, 12, 15]


def test_a_block_longer_than_a_row_is_refused():
    collator = BlockDiagonalCollator(max_length=4, pad_token_id=0, block_per_row=True)
    with pytest.raises(ValueError, match="a block is longer than max_length=4"):
        collator([{"input_ids": [1, 2, 3, 4, 5], "labels": [1, 2, 3, 4, 5], "seq_lengths": [5]}])


def conversations(n):
    return [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"answer number {i}"}]} for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("qwen3_5")


def drain(stream):
    """The real blocks of a stream, the first exhausted block, and the stats they carried."""
    blocks, stats = [], StreamStats()
    for block in stream:
        stats.add(block.get("stream_stats", StreamStats()))
        if block["stream_exhausted"]:
            return blocks, block, stats
        blocks.append(block)


def questions_in(tokenizer, input_ids) -> list[int]:
    text = tokenizer.decode(input_ids)
    return [int(number) for number in re.findall(r"question (\d+)<", text)]


def test_rank_shards_are_disjoint_and_cover_the_data(tokenizer):
    data = Dataset.from_list(conversations(9))
    seen = []
    for rank in range(2):
        stream = RankLocalBlockStream(data, tokenizer, max_length=64, rank=rank, world_size=2)
        blocks, exhausted, stats = drain(stream)
        seen.append(questions_in(tokenizer, [t for b in blocks for t in b["input_ids"]]))
        assert stats.conversations == len(seen[-1])
        assert exhausted["labels"] == [-100] * 64 and exhausted["input_ids"] == [tokenizer.pad_token_id] * 64
    assert set(seen[0]).isdisjoint(seen[1]) and sorted(seen[0] + seen[1]) == list(range(9))


@pytest.mark.parametrize("streamed", [False, True], ids=["map-style", "streamed-jsonl"])
def test_each_rank_and_dataloader_worker_reads_its_own_shard(tokenizer, tmp_path, streamed):
    rows = conversations(23)
    if streamed:  # one file: one datasets shard, so the readers split it conversation by conversation
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        data = load_dataset("json", data_files=str(path), split="train", streaming=True)
    else:
        data = Dataset.from_list(rows)
    collate = collate_blocks(BlockDiagonalCollator(max_length=64, pad_token_id=tokenizer.pad_token_id))
    read, counted = [], 0
    for rank in range(2):
        stream = RankLocalBlockStream(data, tokenizer, max_length=64, rank=rank, world_size=2, split_examples=False)
        exhausted_in_a_row = 0
        # The two workers' batches alternate; once both yield exhausted blocks, the rank's data is through.
        for batch in DataLoader(stream, batch_size=1, num_workers=2, collate_fn=collate):
            counted += batch["stream_stats"].conversations
            exhausted_in_a_row = exhausted_in_a_row + 1 if batch["stream_exhausted"].item() else 0
            if exhausted_in_a_row == 2:
                break
            read += questions_in(tokenizer, batch["input_ids"][0].tolist())
    # Had every worker read its rank's whole shard, each conversation would come twice.
    assert sorted(read) == list(range(23))
    assert counted == 23


def test_stream_supervises_only_assistant_tokens_and_counts_efficiency(tokenizer):
    stream = RankLocalBlockStream(Dataset.from_list(conversations(4)), tokenizer, max_length=32, rank=0, world_size=1)
    blocks, _, stats = drain(stream)
    supervised = tokenizer.decode([t for b in blocks for t, l in zip(b["input_ids"], b["labels"]) if l != -100])
    assert "answer number 0" in supervised and "question" not in supervised and "user" not in supervised
    assert stats.blocks == len(blocks) and stats.real_tokens == sum(len(b["input_ids"]) for b in blocks)
    assert stats.token_slots == 32 * len(blocks) and 0.5 < stats.packing_efficiency <= 1.0
    assert stats.supervised_tokens == sum(l != -100 for b in blocks for l in b["labels"])
    # The attention term of the throughput meter: real segments only, never the padding tail.
    assert stats.squared_segment_lengths == sum(n * n for b in blocks for n in b["seq_lengths"])


def test_conversations_without_assistant_turn_are_counted_and_dropped(tokenizer):
    rows = conversations(2) + [{"messages": [{"role": "user", "content": "hello?"}]}]
    stream = RankLocalBlockStream(Dataset.from_list(rows), tokenizer, max_length=64, rank=0, world_size=1)
    _, _, stats = drain(stream)
    assert stats.dropped == {"no_assistant_turn": 1} and stats.conversations == 3


class StepArgs:
    device = torch.device("cpu")


class Control:
    should_training_stop = False
    should_save = False


class State:
    global_step = 3
    max_steps = 6
    is_world_process_zero = True


def test_stop_flag_without_process_group():
    callback = StopWhenAnyRankExhausted(StreamStats(conversations=3, blocks=1, supervised_tokens=12))
    assert callback.on_step_end(StepArgs(), State(), Control()).should_training_stop is False
    callback.exhausted = True
    control = callback.on_step_end(StepArgs(), State(), Control())
    assert control.should_training_stop and control.should_save
    # kept in the checkpoint's trainer_state.json, so a later run knows the stream ended there
    assert callback.state() == {"args": {}, "attributes": {"data_ended_at_step": 3}}


def test_a_stream_that_ends_before_max_steps_says_so_in_one_line(capsys):
    callback = StopWhenAnyRankExhausted(StreamStats(conversations=3, blocks=1, supervised_tokens=12))
    callback.exhausted = True
    callback.on_step_end(StepArgs(), State(), Control())
    callback.on_train_end(StepArgs(), State(), Control())
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["[data] the packed stream ended at step 3 of max_steps 6: one pass over the streamed data, the run "
                     "ends here. A stream is read once; to train several passes pass --max_steps -1 --num_train_epochs "
                     "N (the stream is then counted before training, every pass in a new order)."]


def test_counted_passes_end_on_their_own_step_not_where_a_reader_runs_out():
    callback = StopWhenAnyRankExhausted(StreamStats(conversations=3, blocks=1, supervised_tokens=12),
                                        passes_counted=True)
    callback.exhausted = True  # a reader ran out in the pass's last step: the next pass reads its shard again
    control = callback.on_step_end(StepArgs(), State(), Control())
    assert not control.should_training_stop and not control.should_save and callback.data_ended_at_step is None


def test_a_stream_that_ends_with_nothing_learned_is_an_error():
    callback = StopWhenAnyRankExhausted(StreamStats(conversations=4, dropped={"no_assistant_turn": 4}))
    callback.exhausted = True
    control = Control()
    with pytest.raises(ValueError, match=r"nothing to learn \(this rank: 4 conversations read \(dropped: 4 no_assistant"):
        callback.on_step_end(StepArgs(), State(), control)
    assert not control.should_save  # no checkpoint of a step that learned nothing
