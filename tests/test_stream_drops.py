"""Drops on the packed path are counted per reason over every reader and rank, and max_dropped_share is
enforced on them while training, on every rank together."""

from __future__ import annotations

import json
import re
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from torch.utils.data import DataLoader

from conftest import REPO_ROOT, launch_sft
from sft_recipes.data.blocks import RankLocalBlockStream, StopWhenAnyRankExhausted, StreamStats, collate_blocks
from sft_recipes.data.collator import BlockDiagonalCollator
from sft_recipes.data.report import MIN_ROWS_BEFORE_DROP_LIMIT, DataReport
from sft_recipes.data.rows import ROW_PROBLEM
from sft_recipes.data.sources import load_checked_dataset, without_marked_rows
from sft_recipes.errors import RecipeError
from sft_recipes.tiny import build_tokenizer

QWEN_TWIN = REPO_ROOT / "recipes" / "tiny" / "qwen27b.yaml"
# A template that leaves out replies starting with "(hidden)": the masking cannot find them in the
# render, so it drops those conversations (prefix_mismatch) by design, whatever the real templates do.
HIDING_TEMPLATE = ("{% for m in messages %}{% if not m.content.startswith('(hidden)') %}"
                   "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat(i: int, reply: str = "answer") -> str:
    return json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                    {"role": "assistant", "content": f"{reply} {i}"}]})


NO_REPLY = json.dumps({"messages": [{"role": "user", "content": "anyone?"}]})
BOT_ROLE = json.dumps({"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "hello"}]})


def streamed_args(path, max_dropped_share=0.05):
    return SimpleNamespace(dataset_name=str(path), dataset_format="messages", dataset_streaming=True,
                           dataset_train_split="train", dataset_config=None, dataset_revision=None,
                           max_train_samples=None, max_dropped_share=max_dropped_share)


def test_every_reader_of_every_rank_counts_bad_rows_and_masking_drops(tmp_path):
    tokenizer = build_tokenizer("qwen3_5")
    tokenizer.chat_template = HIDING_TEMPLATE
    lines = [chat(0), "{not json", chat(1), NO_REPLY, chat(2, "(hidden)"), chat(3), BOT_ROLE, chat(4),
             chat(5, "(hidden)"), NO_REPLY, chat(6), chat(7, "(hidden)"), chat(8)]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n")
    rows, report = load_checked_dataset(streamed_args(path), mark_bad_rows=True)
    collate = collate_blocks(BlockDiagonalCollator(max_length=512, pad_token_id=tokenizer.pad_token_id))
    per_rank = []
    for rank in range(2):  # 2 ranks x 2 dataloader workers: 4 readers, every 4th line each
        stream = RankLocalBlockStream(rows, tokenizer, max_length=512, rank=rank, world_size=2)
        stats, exhausted_in_a_row = StreamStats(), 0
        for batch in DataLoader(stream, batch_size=1, num_workers=2, collate_fn=collate):
            stats.add(batch["stream_stats"])
            exhausted_in_a_row = exhausted_in_a_row + 1 if batch["stream_exhausted"].item() else 0
            if exhausted_in_a_row == 2:
                break
        per_rank.append(stats)
    # Readers 0, 1 (rank 0) read lines 0,1,4,5,8,9,12; readers 2, 3 (rank 1) lines 2,3,6,7,10,11.
    assert (per_rank[0].conversations, per_rank[0].dropped) == (7, {"invalid_json": 1, "prefix_mismatch": 2,
                                                                    "no_assistant_turn": 1})
    assert (per_rank[1].conversations, per_rank[1].dropped) == (6, {"no_assistant_turn": 1, "unknown_role": 1,
                                                                    "prefix_mismatch": 1})
    total = per_rank[0].add(per_rank[1])
    assert total.dropped == {"invalid_json": 1, "no_assistant_turn": 2, "unknown_role": 1, "prefix_mismatch": 3}
    assert total.supervised_tokens > 0 and report.streamed and report.rows == 0


def test_a_streamed_hub_dataset_read_for_blocks_keeps_its_bad_rows_flagged(monkeypatch):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad = {"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    stream = Dataset.from_list([good, bad, good]).to_iterable_dataset()
    monkeypatch.setattr("sft_recipes.data.sources.load_raw_dataset", lambda args: stream)
    rows, _ = load_checked_dataset(streamed_args("org/chat-data"), mark_bad_rows=True)
    assert [row[ROW_PROBLEM] for row in rows] == [None, "unknown_role", None]
    assert [row["messages"] for row in without_marked_rows(rows)] == [good["messages"]] * 2


def test_a_bad_row_is_counted_with_the_block_read_after_it(tmp_path):
    """The running share is honest only if bad rows are counted where they are read, not a batch ahead."""
    tokenizer = build_tokenizer("qwen3_5")
    length = len(tokenizer.apply_chat_template(json.loads(chat(0))["messages"], tokenize=True)["input_ids"])
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join([chat(0), "{not json", chat(1), NO_REPLY, "{not json", chat(2)]) + "\n")
    rows, _ = load_checked_dataset(streamed_args(path), mark_bad_rows=True)
    stream = iter(RankLocalBlockStream(rows, tokenizer, max_length=length, rank=0, world_size=1))
    carried = [next(stream)["stream_stats"] for _ in range(3)]  # one conversation fills a block exactly
    assert [(stats.conversations, stats.dropped) for stats in carried] == [
        (1, {}), (2, {"invalid_json": 1}), (3, {"no_assistant_turn": 1, "invalid_json": 1})]


def test_the_packed_share_is_the_map_share_of_the_same_rows():
    """300 rows, 30 bad up front, 81 of the other 270 dropped by the masking: 37% either way."""
    mapped = DataReport("x", rows=300)
    mapped.dropped["unknown_role"] = 30
    mapped.count_masking({"prefix_mismatch": 81}, trainable_tokens=1000)
    packed = DataReport("x", rows=300)
    packed.dropped["unknown_role"] = 30
    with pytest.raises(RecipeError) as refusal:
        packed.count_stream(StreamStats(conversations=270, dropped={"prefix_mismatch": 81}), stream_ended=False,
                            max_dropped_share=0.05)
    assert packed.dropped_share == pytest.approx(mapped.dropped_share) == pytest.approx(0.37)
    message = str(refusal.value)
    assert message.startswith("Refusing to go on: 37.00% of the rows are dropped, more than max_dropped_share=0.05")
    assert ("after 30 of 300 rows dropped up front, the packed stream read 270 conversations and dropped "
            "prefix_mismatch 81") in message
    assert "--audit-data" in message and "raise max_dropped_share" in message


def test_the_running_share_waits_for_enough_rows_unless_the_stream_ended():
    report = DataReport("stream", streamed=True)
    below = StreamStats(conversations=MIN_ROWS_BEFORE_DROP_LIMIT - 1, dropped={"invalid_json": 60})
    report.count_stream(below, stream_ended=False, max_dropped_share=0.05)  # too few rows to judge yet
    assert report.as_dict()["read_while_training"] == {"rows": 199, "dropped": {"invalid_json": 60}}
    with pytest.raises(RecipeError, match=r"30\.15% of the rows are dropped.*read 199 conversations and dropped "
                                          r"invalid_json 60"):
        report.count_stream(below, stream_ended=True, max_dropped_share=0.05)
    report.count_stream(StreamStats(conversations=400, dropped={"invalid_json": 20}), stream_ended=False,
                        max_dropped_share=0.05)  # exactly 5%: allowed
    assert report.dropped_share == 0.05


def test_the_step_callback_hands_the_summed_counts_to_the_drop_limit():
    report = DataReport("stream", streamed=True)
    trained = StreamStats(conversations=250, blocks=3, supervised_tokens=40, dropped={"no_assistant_turn": 50})
    callback = StopWhenAnyRankExhausted(trained, partial(report.count_stream, max_dropped_share=0.05))
    control = SimpleNamespace(should_training_stop=False, should_save=False)
    with pytest.raises(RecipeError, match=r"20\.00% of the rows"):
        callback.on_step_end(SimpleNamespace(device=torch.device("cpu")), None, control)
    assert callback.total == trained and report.stream_rows == 250 and not control.should_save


def write_stream(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.fsdp
def test_too_many_bad_streamed_rows_refuse_on_every_rank_without_a_hang(tmp_path):
    # 40% bad: every 5th and 5th+1 line.
    lines = [NO_REPLY if i % 5 == 0 else "{not json" if i % 5 == 1 else chat(i) for i in range(500)]
    data = write_stream(tmp_path / "bad.jsonl", lines)
    result = launch_sft(QWEN_TWIN, "--dataset_name", str(data), "--output_dir", str(tmp_path / "out"),
                        "--report_to", "none", "--max_length", "1024", check=False)
    errors = re.findall(r"error: .*", result.stderr)  # (after a progress bar on the same line)
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-4000:]
    assert re.match(r"error: Refusing to go on: (3[5-9]|4[0-5])\.\d\d% of the rows are dropped, more than "
                    r"max_dropped_share=0\.05", errors[0]), errors[0]
    assert "dropped invalid_json " in errors[0] and ", no_assistant_turn " in errors[0], errors[0]
    # torchrun's report: every rank refused (2) or was stopped by torchrun once the first one had (SIGTERM)
    codes = re.findall(r"exitcode  : (-?\d+)", result.stderr)
    assert "2" in codes and set(codes) <= {"2", "-15"}, codes
    assert not re.search(r'File ".*(sft_recipes|scripts/sft\.py)', result.stderr)  # no traceback of ours


@pytest.mark.fsdp
def test_streamed_drops_reach_the_end_line_and_data_report(tmp_path):
    # 36 lines, 4 readers (2 ranks x 2 workers), every 4th line each: every reader's rows fit one block.
    lines = ["{not json" if i % 12 == 5 else NO_REPLY if i % 12 == 10 else chat(i) for i in range(36)]
    data = write_stream(tmp_path / "some_bad.jsonl", lines)
    out = tmp_path / "out"
    result = launch_sft(QWEN_TWIN, "--dataset_name", str(data), "--output_dir", str(out), "--report_to", "none",
                        "--max_dropped_share", "0.2", "--max_length", "1024")
    # Rank 0 reads lines with i % 4 in (0, 1): 5, 17, 29 (invalid_json); rank 1 the rest: 10, 22, 34.
    assert "[data] rank 0 trained on 18 conversations read (dropped: 3 invalid_json)" in result.stderr
    assert "[data] rank 1 trained on 18 conversations read (dropped: 3 no_assistant_turn)" in result.stderr
    assert "[data] all 2 ranks trained on 36 conversations read (dropped: 3 invalid_json, 3 no_assistant_turn)" \
        in result.stderr
    report = json.loads((out / "data_report.json").read_text())
    assert report["read_while_training"] == {"rows": 36, "dropped": {"invalid_json": 3, "no_assistant_turn": 3}}
    assert report["dropped_share"] == pytest.approx(6 / 36, abs=1e-6)
