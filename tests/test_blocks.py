"""Packed block streams: literal tokens in, exact blocks out; disjoint rank shards; a shared stop."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset

from sft_recipes.data.blocks import RankLocalBlockStream, StopWhenAnyRankExhausted, collate_blocks, pack_blocks
from sft_recipes.data.packing import BlockDiagonalCollator
from sft_recipes.tiny import build_tokenizer

EXAMPLES = [
    {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
    {"input_ids": [4, 5, 6, 7, 8], "labels": [-100, -100, 6, 7, 8]},
    {"input_ids": [9, 10], "labels": [9, 10]},
]


def test_split_examples_fills_every_block_like_the_seed():
    blocks = list(pack_blocks(EXAMPLES, max_length=4, split_examples=True))
    assert blocks == [
        {"input_ids": [1, 2, 3, 4], "labels": [-100, 2, 3, -100], "seq_lengths": [3, 1]},
        {"input_ids": [5, 6, 7, 8], "labels": [-100, 6, 7, 8], "seq_lengths": [4]},
        {"input_ids": [9, 10], "labels": [9, 10], "seq_lengths": [2]},
    ]


def test_whole_examples_start_a_new_block_and_long_ones_are_cut():
    blocks = list(pack_blocks(EXAMPLES, max_length=4, split_examples=False))
    assert blocks == [
        {"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "seq_lengths": [3]},
        {"input_ids": [4, 5, 6, 7], "labels": [-100, -100, 6, 7], "seq_lengths": [4]},
        {"input_ids": [9, 10], "labels": [9, 10], "seq_lengths": [2]},
    ]


def test_collated_blocks_reset_positions_and_mask_segment_starts():
    collate = collate_blocks(BlockDiagonalCollator(max_length=4, pad_token_id=0))
    blocks = [{**b, "stream_exhausted": 0} for b in pack_blocks(EXAMPLES, max_length=4)]
    batch = collate(blocks)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 2, 3], [0, 1, 0, 1]]
    assert batch["seq_idx"].tolist() == [[0, 0, 0, 1], [2, 2, 2, 2], [3, 3, 4, 4]]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100], [-100, 6, 7, 8], [-100, 10, -100, -100]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 4, 8, 10, 12]
    assert batch["stream_exhausted"].item() == 0


def conversations(n):
    return [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"answer number {i}"}]} for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("qwen3_5")


def drain(stream):
    blocks = []
    for block in stream:
        if block["stream_exhausted"]:
            return blocks, block
        blocks.append(block)


def test_rank_shards_are_disjoint_and_cover_the_data(tokenizer):
    data = Dataset.from_list(conversations(9))
    seen = []
    for rank in range(2):
        stream = RankLocalBlockStream(data, tokenizer, max_length=64, rank=rank, world_size=2)
        blocks, exhausted = drain(stream)
        text = tokenizer.decode([t for b in blocks for t in b["input_ids"]])
        seen.append({i for i in range(9) if f"question {i}<" in text})
        assert stream.stats.conversations == len(seen[-1])
        assert exhausted["labels"] == [-100] * 64 and exhausted["input_ids"] == [tokenizer.pad_token_id] * 64
    assert seen[0].isdisjoint(seen[1]) and seen[0] | seen[1] == set(range(9))


def test_stream_supervises_only_assistant_tokens_and_counts_efficiency(tokenizer):
    stream = RankLocalBlockStream(Dataset.from_list(conversations(4)), tokenizer, max_length=32, rank=0, world_size=1)
    blocks, _ = drain(stream)
    supervised = tokenizer.decode([t for b in blocks for t, l in zip(b["input_ids"], b["labels"]) if l != -100])
    assert "answer number 0" in supervised and "question" not in supervised and "user" not in supervised
    stats = stream.stats
    assert stats.real_tokens == sum(len(b["input_ids"]) for b in blocks)
    assert stats.token_slots == 32 * len(blocks) and 0.5 < stats.packing_efficiency <= 1.0


def test_conversations_without_assistant_turn_are_counted_and_dropped(tokenizer):
    rows = conversations(2) + [{"messages": [{"role": "user", "content": "hello?"}]}]
    stream = RankLocalBlockStream(Dataset.from_list(rows), tokenizer, max_length=64, rank=0, world_size=1)
    drain(stream)
    assert stream.stats.dropped == {"no_assistant_turn": 1} and stream.stats.conversations == 3


def test_stop_flag_without_process_group():
    class Args:
        device = torch.device("cpu")

    class Control:
        should_training_stop = False
        should_save = False

    callback = StopWhenAnyRankExhausted()
    assert callback.on_step_end(Args(), None, Control()).should_training_stop is False
    callback.exhausted = True
    control = callback.on_step_end(Args(), None, Control())
    assert control.should_training_stop and control.should_save
