"""Drops on the packed path are counted per reason over every reader and rank, and max_dropped_share is
enforced on them while training, on every rank together."""

from __future__ import annotations

import json
import re
from functools import partial
from types import SimpleNamespace

import pytest
import yaml
import torch
from datasets import Dataset
from torch.utils.data import DataLoader

from conftest import REPO_ROOT, TINY_LLAMA_RECIPE, launch_sft
from sft_recipes.data.blocks import (
    IGNORE_INDEX,
    RankLocalBlockStream,
    SourceCounts,
    StopWhenAnyRankExhausted,
    StreamStats,
    collate_blocks,
    summed_over_ranks,
)
from sft_recipes.data.collator import BlockDiagonalCollator
from sft_recipes.data.report import MIN_ROWS_BEFORE_DROP_LIMIT, DataReport, MixtureReport, SourceReport
from sft_recipes.data.rows import ROW_PROBLEM
from sft_recipes.data.sources import load_checked_dataset, without_marked_rows
from sft_recipes.data.stream_reads import StreamedRowDropsCallback
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
    # Reader worker x 2 + rank (data.blocks.reader_index): readers 0, 2 (rank 0) read lines 0,2,4,...,12;
    # readers 1, 3 (rank 1) lines 1,3,...,11.
    assert (per_rank[0].conversations, per_rank[0].dropped) == (7, {"prefix_mismatch": 2, "unknown_role": 1})
    assert (per_rank[1].conversations, per_rank[1].dropped) == (6, {"invalid_json": 1, "no_assistant_turn": 2,
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
    mapped.count_masking({"prefix_mismatch": 81}, supervised_tokens=1000)
    packed = DataReport("x", rows=300)
    packed.dropped["unknown_role"] = 30
    with pytest.raises(RecipeError) as refusal:
        packed.count_stream(StreamStats(conversations=270, dropped={"prefix_mismatch": 81}), stream_ended=False,
                            max_dropped_share=0.05)
    assert packed.dropped_share == pytest.approx(mapped.dropped_share) == pytest.approx(0.37)
    message = str(refusal.value)
    assert message.startswith("Refusing to go on: 37.00% of the rows of x are dropped, more than max_dropped_share=0.05")
    assert ("after 30 of 300 rows dropped up front, the stream read 270 rows while training and dropped "
            "prefix_mismatch 81") in message
    assert "--audit-data" in message and "raise max_dropped_share" in message
    assert "; packed while training: 270 read, dropped prefix_mismatch 81 (37.00% dropped in all)" in packed.format()


def test_the_running_share_waits_for_enough_rows_unless_the_stream_ended():
    report = DataReport("stream", streamed=True)
    below = StreamStats(conversations=MIN_ROWS_BEFORE_DROP_LIMIT - 1, dropped={"invalid_json": 60})
    report.count_stream(below, stream_ended=False, max_dropped_share=0.05)  # too few rows to judge yet
    assert report.as_dict()["read_while_training"] == {"rows": 199, "dropped": {"invalid_json": 60}}
    with pytest.raises(RecipeError, match=r"30\.15% of the rows of stream are dropped.*read 199 rows while training and dropped "
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
    assert (callback.total.conversations, callback.total.dropped) == (250, trained.dropped)
    assert report.stream_rows == 250 and not control.should_save


def test_a_mixture_s_readers_count_each_source_and_its_limit_names_it():
    """Per-source counts travel through the same all-reduce; each source is judged on its own rows."""
    alpaca, chat = SourceReport(DataReport("alpaca.jsonl", streamed=True)), SourceReport(DataReport("chat.jsonl"))
    chat.checked.rows = 100  # map-style: read up front, 2 dropped there
    chat.checked.dropped["unknown_role"] = 2
    report = MixtureReport(sources=[alpaca, chat], streamed=True)
    read = StreamStats()
    for _ in range(190):
        read.keep([IGNORE_INDEX, 5, 6, IGNORE_INDEX], source=0)  # 4 tokens, 2 targets (5 and 6)
    for _ in range(98):
        read.keep([1, 2, 3], source=1)
    for _ in range(10):
        read.drop("invalid_json", source=0)
    total, ended = summed_over_ranks(read, exhausted=False, device=torch.device("cpu"), num_sources=2)
    assert not ended and total.conversations == 298
    assert total.sources[0] == SourceCounts(200, 760, 380, {"invalid_json": 10})
    assert total.sources[1] == SourceCounts(98, 294, 196, {})
    with pytest.raises(RecipeError, match=r"5\.00% of the rows of alpaca.jsonl are dropped"):
        report.count_stream(total, stream_ended=False, max_dropped_share=0.04)
    report.count_stream(total, stream_ended=False, max_dropped_share=0.05)
    summary = report.as_dict()
    assert [(s["tokens"], s["supervised_tokens"]) for s in summary["sources"]] == [(760, 380), (294, 196)]
    assert [s["supervised_token_share"] for s in summary["sources"]] == [round(380 / 576, 6), round(196 / 576, 6)]
    assert summary["read_while_training"] == {"rows": 298, "dropped": {"invalid_json": 10}}


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
    assert re.match(r"error: Refusing to go on: (3[5-9]|4[0-5])\.\d\d% of the rows of \S+ are dropped, more than "
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
    # Reader worker x 2 + rank: rank 0 reads the even lines, 10, 22, 34 (no_assistant_turn); rank 1 5, 17, 29.
    assert "[data] rank 0 trained on 18 conversations read (dropped: 3 no_assistant_turn)" in result.stderr
    assert "[data] rank 1 trained on 18 conversations read (dropped: 3 invalid_json)" in result.stderr
    assert "[data] all 2 ranks trained on 36 conversations read (dropped: 3 invalid_json, 3 no_assistant_turn)" \
        in result.stderr
    report = json.loads((out / "data_report.json").read_text())
    assert report["read_while_training"] == {"rows": 36, "dropped": {"invalid_json": 3, "no_assistant_turn": 3}}
    assert report["dropped_share"] == pytest.approx(6 / 36, abs=1e-6)


def test_a_stream_read_unpacked_counts_the_rows_where_they_are_read_and_limits_their_share(tmp_path, monkeypatch):
    """TRL's pipeline reads the stream in the training process (dataloader_num_workers: 0, the linter's rule)."""
    monkeypatch.setattr("sft_recipes.data.sources.STREAM_READS", {})
    alpaca = (REPO_ROOT / "data" / "samples" / "alpaca.jsonl").read_text().splitlines()
    path = write_stream(tmp_path / "alpaca.jsonl", ["{not json" if i % 4 == 1 else alpaca[i] for i in range(300)])
    args = SimpleNamespace(**{**vars(streamed_args(path)), "dataset_format": "alpaca"})
    rows, report = load_checked_dataset(args)
    device = SimpleNamespace(device=torch.device("cpu"))
    first = [row["instruction"] for _, row in zip(range(100), rows)]  # 100 good rows: lines 0-132, 33 bad
    assert first[:2] == [json.loads(alpaca[0])["instruction"], json.loads(alpaca[2])["instruction"]]
    StreamedRowDropsCallback([report], max_dropped_share=0.2).on_step_end(device, None, None)  # < 200: not judged
    assert (report.stream_rows, dict(report.stream_dropped)) == (133, {"invalid_json": 33})
    assert sum(1 for _ in rows) == 225  # a whole pass: 300 lines, 75 bad; with the first 133, 108 of 433 bad
    with pytest.raises(RecipeError, match=r"24\.94% of the rows of .*alpaca.jsonl are dropped, more than "
                                          r"max_dropped_share=0\.2 \(the stream read 433 rows"):
        StreamedRowDropsCallback([report], max_dropped_share=0.2).on_train_end(device, None, None)


@pytest.mark.fsdp
def test_a_streamed_mixture_counts_each_source_and_refuses_the_bad_one_by_name(tmp_path):
    clean = write_stream(tmp_path / "clean.jsonl", [chat(i) for i in range(400)])
    bad = write_stream(tmp_path / "bad.jsonl", ["{not json" if i % 3 == 0 else chat(i) for i in range(400)])
    recipe = yaml.safe_load(QWEN_TWIN.read_text())
    for key in ("dataset_name", "dataset_train_split", "dataset_streaming", "dataset_revision"):
        del recipe[key]
    recipe.update(streaming=True, datasets=[{"path": str(clean), "fraction": 0.5}, {"path": str(bad), "fraction": 0.5}])
    path = tmp_path / "mixture.yaml"
    path.write_text(yaml.safe_dump(recipe))
    common = ("--report_to", "none", "--max_length", "1024")
    result = launch_sft(path, "--output_dir", str(tmp_path / "refused"), *common, check=False)
    errors = re.findall(r"error: .*", result.stderr)
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-4000:]
    assert re.match(rf"error: Refusing to go on: 3\d\.\d\d% of the rows of {re.escape(str(bad))} are dropped", errors[0])
    # Allowed: both sources' rows, tokens and drops counted over every reader, in data_report.json.
    out = tmp_path / "allowed"
    result = launch_sft(path, "--output_dir", str(out), *common, "--max_dropped_share", "0.4")
    clean_report, bad_report = json.loads((out / "data_report.json").read_text())["sources"]
    end = result.stdout[result.stdout.index("[data] read while training:"):]
    assert re.search(rf"source 1 {re.escape(str(bad))}: streamed; the stream read {bad_report['read_while_training']['rows']} "
                     r"rows while training and dropped invalid_json \d+ \(3\d\.\d\d%\)", end), end
    assert f"{bad_report['supervised_tokens']:,} supervised" in end
    assert clean_report["read_while_training"]["dropped"] == {} and clean_report["supervised_tokens"] > 0
    read = bad_report["read_while_training"]
    assert read["dropped"]["invalid_json"] == pytest.approx(read["rows"] / 3, abs=1)
    assert bad_report["dropped_share"] == pytest.approx(1 / 3, abs=0.01)


@pytest.mark.fsdp
def test_a_stream_read_unpacked_by_two_processes_counts_each_row_once(tmp_path):
    """accelerate hands every rank this one-file stream whole (each keeps its batches): the rows read are
    counted once, not once per rank, and too many bad ones refuse on every rank together."""
    alpaca = (REPO_ROOT / "data" / "samples" / "alpaca.jsonl").read_text().splitlines()
    path = write_stream(tmp_path / "alpaca.jsonl", ["{not json" if i % 10 == 3 else alpaca[i] for i in range(300)])
    common = ("--dataset_name", str(path), "--dataset_streaming", "true", "--max_steps", "3", "--report_to", "none")
    out = tmp_path / "allowed"
    launch_sft(TINY_LLAMA_RECIPE, *common, "--max_dropped_share", "0.2", "--output_dir", str(out))
    (source,) = json.loads((out / "data_report.json").read_text())["sources"]
    assert source["read_while_training"] == {"rows": 300, "dropped": {"invalid_json": 30}}
    result = launch_sft(TINY_LLAMA_RECIPE, *common, "--output_dir", str(tmp_path / "refused"), check=False)
    errors = re.findall(r"error: .*", result.stderr)
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-4000:]
    assert errors[0].startswith(f"error: Refusing to go on: 10.00% of the rows of {path} are dropped, more than "
                                "max_dropped_share=0.05 (the stream read 300 rows while training")
