"""Mixtures (`datasets:`), held-out eval rows by row hash, and the per-source data report."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import yaml
from datasets import Dataset, IterableDataset
from datasets.distributed import split_dataset_by_node
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from conftest import REPO_ROOT
from sft_recipes.config import load_recipe
from sft_recipes.data.blocks import RankLocalBlockStream
from sft_recipes.data.formats import FORMATS, Tokenization, alpaca_to_prompt_completion
from sft_recipes.data.heldout import is_held_out, split_held_out
from sft_recipes.data.mixture import describe_eval, draw_rows, mixture_rows, token_counts, training_sources
from sft_recipes.data.report import DataReport
from sft_recipes.data.sources import DatasetSource, load_checked_dataset
from sft_recipes.data.stream_reads import StreamedRowDropsCallback
from sft_recipes.errors import RecipeError
from sft_recipes.run import Run
from sft_recipes.run.data import source_data
from sft_recipes.tiny import ensure_tiny

EXAMPLE = REPO_ROOT / "recipes" / "examples" / "tiny_llama_mixture.yaml"
ALPACA = "data/samples/alpaca.jsonl"
ULTRACHAT = "data/samples/ultrachat.jsonl"


def build_source_data(recipe, tokenizer):
    """The recipe's sources as its run reads them (`sft_recipes.run.data.source_data`)."""
    return source_data(Run(recipe=recipe, source=None, batch_derivation=""), tokenizer)


def write_recipe(tmp_path, **values):
    base = {"model_name_or_path": "tiny:llama", "output_dir": str(tmp_path / "out"), "use_cpu": True, "bf16": False}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**base, **values}))
    return path


# ── Recipe keys ─────────────────────────────────────────────────────────────────────────────────

def test_example_recipe_gives_one_source_per_entry_with_its_own_format():
    recipe = load_recipe(EXAMPLE)
    assert training_sources(recipe.data) == [
        DatasetSource(path=ALPACA, dataset_format="alpaca", fraction=0.7),
        DatasetSource(path=ULTRACHAT, dataset_format="messages", fraction=0.3),
    ]
    assert recipe.data.test_split_size == 0.05


def test_single_dataset_keys_are_a_one_entry_mixture(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, dataset_name=ALPACA, dataset_format="alpaca", dataset_revision="v1"))
    assert training_sources(recipe.data) == [DatasetSource(path=ALPACA, dataset_format="alpaca", revision="v1")]


def test_every_bad_entry_is_named_at_once_with_its_fix(tmp_path):
    datasets = [{"path": ALPACA, "dataset_format": "alpaca", "fration": 0.5},
                {"path": ULTRACHAT, "dataset_format": "chat", "fraction": 0}]
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(tmp_path, datasets=datasets, test_split_size=1.5))
    message = str(err.value)
    assert "datasets[0]: unknown key 'fration'; did you mean 'fraction'?" in message
    assert ("datasets[1]: dataset_format must be one of ['alpaca', 'alpaca_chat', 'messages', 'reasoning', 'text', "
            "'prompt_completion', 'prompt_completion_chat', 'sharegpt', 'vision_messages'], got 'chat'") in message
    assert "datasets[1]: fraction must be a number > 0" in message
    assert "test_split_size is the share of rows held out for eval, in (0, 1); got 1.5" in message


@pytest.mark.parametrize(("values", "problem"), [
    ({"dataset_name": ALPACA, "datasets": [{"path": ALPACA}]}, "either dataset_name (one dataset) or datasets"),
    ({"datasets": [{"path": ALPACA, "fraction": 1}, {"path": ULTRACHAT}]}, "give `fraction` on every entry or on none"),
    ({"datasets": [{"path": ULTRACHAT, "dataset_format": "messages"}], "streaming": True},
     "is streamed with dataset_format 'messages': streamed conversations are read by the packed block stream"),
    ({"dataset_name": ULTRACHAT, "dataset_format": "messages", "dataset_streaming": True},
     "is streamed with dataset_format 'messages': streamed conversations are read by the packed block stream (each "
     "rank reads and packs its own shard, counting what it drops): set pack_blocks: true, or dataset_streaming: false"),
    ({"datasets": [{"path": ALPACA, "dataset_format": "alpaca"}], "pack_blocks": True},
     "has dataset_format 'alpaca'; pack_blocks packs chat conversations"),
    ({"dataset_name": ALPACA, "test_split_size": 0.1, "eval_datasets": [{"path": ALPACA}]},
     "either eval_datasets or test_split_size"),
    ({"dataset_name": ALPACA, "eval_datasets": [{"path": ALPACA, "fraction": 0.5}]}, "`fraction` is not used for eval"),
    ({"datasets": [{"path": ALPACA}], "max_train_samples": 5}, "in a mixture give each source a fraction"),
    ({"datasets": []}, "no training data"),
])
def test_inconsistent_data_keys_are_refused(tmp_path, values, problem):
    with pytest.raises(RecipeError, match="DataArguments rejected the recipe") as err:
        load_recipe(write_recipe(tmp_path, **values))
    assert problem in str(err.value)


# ── Shares ──────────────────────────────────────────────────────────────────────────────────────

def test_fractions_are_shares_of_the_mixture_and_the_strategy_sets_its_size():
    # first_exhausted (TRL's rule): the largest mixture with no source repeated, 283 / 0.7 = 404.3 rows.
    assert mixture_rows([283, 192], [0.7, 0.3], "first_exhausted") == [283, 121]
    # all_exhausted: the smallest with every source whole, 192 / 0.3 = 640 rows; the first source is repeated.
    assert mixture_rows([283, 192], [0.7, 0.3], "all_exhausted") == [448, 192]
    assert mixture_rows([283, 192], [7, 3], "first_exhausted") == [283, 121]  # normalised
    assert mixture_rows([283, 192], [None, None], "all_exhausted") == [283, 192]  # no fractions: every row once


def test_a_source_asked_for_more_rows_than_it_has_is_repeated_whole_then_sampled():
    rows = Dataset.from_list([{"n": n} for n in range(3)])
    drawn = draw_rows(rows, 8, seed=0)["n"]
    assert drawn[:6] == [0, 1, 2, 0, 1, 2]  # two whole copies
    assert len(set(drawn[6:])) == 2 and set(drawn[6:]) <= {0, 1, 2}  # then two different rows sampled
    assert draw_rows(rows, 8, seed=0)["n"] == drawn  # seeded
    assert len(set(draw_rows(rows, 2, seed=0)["n"])) == 2  # fewer rows than the source: a sample, no repeat


# ── Held-out rows ───────────────────────────────────────────────────────────────────────────────

def test_held_out_rows_depend_on_the_row_only_and_their_share_is_close_to_the_size():
    rows = [{"text": f"example number {n}"} for n in range(4000)]
    train, held_out = split_held_out(Dataset.from_list(rows), 0.1)
    assert abs(len(held_out) / len(rows) - 0.1) < 0.015  # 4000 rows: one standard deviation is 0.0047
    assert not set(train["text"]) & set(held_out["text"])
    assert len(train) + len(held_out) == len(rows)
    # Another order, and the rows read in shards by 2 ranks x 2 workers, hold out the same rows.
    _, reordered = split_held_out(Dataset.from_list(rows[::-1]), 0.1)
    assert set(reordered["text"]) == set(held_out["text"])
    stream = Dataset.from_list(rows).to_iterable_dataset(num_shards=8)
    sharded = set()
    for reader in range(4):
        shard = split_dataset_by_node(stream, rank=reader, world_size=4)
        sharded |= {row["text"] for row in shard if is_held_out(row, 0.1)}
    assert sharded == set(held_out["text"])


def test_streamed_source_holds_out_exactly_the_rows_a_map_style_run_holds_out(tmp_path):
    args = training_sources(load_recipe(write_recipe(tmp_path, dataset_name=ULTRACHAT)).data)[0]
    map_rows, _ = load_checked_dataset(args.as_data_args("datasets", streaming=False))
    stream, _ = load_checked_dataset(args.as_data_args("datasets", streaming=True))
    map_train, map_eval = split_held_out(map_rows, 0.2)
    stream_train, stream_eval = split_held_out(stream, 0.2)
    assert isinstance(stream_train, IterableDataset)
    key = lambda row: json.dumps(row, sort_keys=True)  # noqa: E731
    assert sorted(map(key, stream_eval)) == sorted(map(key, map_eval)) and len(map_eval) > 0
    assert sorted(map(key, stream_train)) == sorted(map(key, map_train))


# ── Building the mixture ────────────────────────────────────────────────────────────────────────

@pytest.fixture(scope="module")
def example_data():
    recipe = load_recipe(EXAMPLE)
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny("llama"))
    return recipe, tokenizer, build_source_data(recipe, tokenizer)


def test_example_mixture_report_per_source(example_data):
    _, _, data = example_data
    summary = data.report.as_dict()
    alpaca, chat = summary["sources"]
    # 300 alpaca rows, 17 held out by hash; 200 conversations, 8 held out: the 0.7 / 0.3 shares cap the mixture.
    assert (alpaca["rows"], alpaca["eval_rows"], alpaca["training_rows"], alpaca["mixture_rows"]) == (300, 17, 283, 283)
    assert (chat["rows"], chat["eval_rows"], chat["training_rows"], chat["mixture_rows"]) == (200, 8, 192, 121)
    assert len(data.train) == 283 + 121 and len(data.eval) == 17 + 8
    assert alpaca["supervised_token_share"] + chat["supervised_token_share"] == pytest.approx(1.0)
    labels = data.train["labels"]
    assert sum(len(row) - 1 - row[1:].count(-100) for row in labels) == alpaca["supervised_tokens"] + chat["supervised_tokens"]
    assert summary["supervised_tokens"] == alpaca["supervised_tokens"] + chat["supervised_tokens"]
    assert summary["tokens"] == sum(len(row) for row in labels) == alpaca["tokens"] + chat["tokens"]
    # One meaning: the loss's targets. The alpaca source is drawn whole (283 of 283), so its kept rows' count is the
    # count of what trains; the chat source gives 121 of its 192 rows, so what trains is fewer.
    assert alpaca["kept_supervised_tokens"] == alpaca["supervised_tokens"]
    assert chat["kept_supervised_tokens"] > chat["supervised_tokens"]
    text = data.report.format()
    assert "trainable" not in text and "source 0 data/samples/alpaca.jsonl: 300 rows read, kept 300" in text
    assert f"in the mixture: 283 of 283 training rows (fraction 0.7), {alpaca['tokens']:,} tokens, " \
        f"{alpaca['supervised_tokens']:,} supervised" in text
    params = data.report.mlflow_params()
    assert params["data.source1.mixture_rows"] == 121 and params["data.source0.times_used"] == 1.0


def test_example_mixture_shuffles_sources_together_and_never_trains_on_eval_rows(example_data):
    _, _, data = example_data
    is_alpaca = ["### Instruction" in text for text in
                 example_data[1].batch_decode([ids[:8] for ids in data.train["input_ids"]])]
    assert 0 < is_alpaca.index(False) < 20 and is_alpaca[-20:].count(True) not in (0, 20)  # interleaved, not A then B
    train = {tuple(ids) for ids in data.train["input_ids"]}
    assert not any(tuple(ids) in train for ids in data.eval["input_ids"])


def test_alpaca_source_tokens_and_labels_equal_trls_own_tokenization(example_data, tmp_path):
    recipe, tokenizer, _ = example_data
    rows, _ = load_checked_dataset(training_sources(recipe.data)[0].as_data_args("datasets", streaming=False))
    rows = rows.select(range(12))
    for completion_only in (None, False):
        ours = FORMATS["alpaca"].to_tokens(rows, tokenizer, Tokenization(256, completion_only_loss=completion_only),
                                           DataReport(source=ALPACA))
        trainer = SFTTrainer(
            model=AutoModelForCausalLM.from_pretrained(ensure_tiny("llama")),
            args=SFTConfig(output_dir=str(tmp_path), max_length=256, completion_only_loss=completion_only,
                           report_to=[], use_cpu=True, bf16=False),
            train_dataset=rows.map(alpaca_to_prompt_completion, remove_columns=rows.column_names),
            processing_class=tokenizer,
        )
        theirs = trainer.train_dataset
        assert ours["input_ids"] == theirs["input_ids"]
        assert ours["labels"] == theirs["labels"]
        assert (-100 in ours["labels"][0]) is (completion_only is None)


def test_all_exhausted_repeats_the_smaller_share_and_reports_it(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, datasets=[
        {"path": ALPACA, "dataset_format": "alpaca", "fraction": 0.5},
        {"path": ULTRACHAT, "dataset_format": "messages", "fraction": 0.5},
    ], mixture_strategy="all_exhausted", max_length=256))
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny("llama"))
    data = build_source_data(recipe, tokenizer)
    alpaca, chat = data.report.as_dict()["sources"]
    assert (alpaca["mixture_rows"], chat["mixture_rows"]) == (300, 300)
    assert chat["times_used"] == 1.5 and "repeated 1.50x" in data.report.format()
    assert data.eval is None



def test_a_source_of_mostly_bad_rows_that_holds_out_no_row_is_refused_for_its_bad_rows(tmp_path):
    # it was refused with "test_split_size=0.05 holds out no row of ...: raise test_split_size": the wrong fix
    good = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in [good, {"messages": "Hi?"}, {"messages": "Hello?"}]))
    recipe = load_recipe(write_recipe(tmp_path, dataset_name=str(path), test_split_size=0.05))
    assert not is_held_out(good, 0.05)  # the split leaves no eval row
    with pytest.raises(RecipeError) as error:
        build_source_data(recipe, AutoTokenizer.from_pretrained(ensure_tiny("llama")))
    assert str(error.value) == (
        f"Refusing to train: 66.67% of the rows are bad, more than max_dropped_share=0.05 ({path}: 3 rows read, kept "
        "1, dropped 2 (66.67%: not_a_message_list 2), truncated 0; first not_a_message_list row, line 2: "
        '{"messages": "Hi?"}). Fix the rows, check dataset_format, or raise max_dropped_share if dropping them is '
        "intended.")

def test_eval_datasets_rows_dropped_as_read_are_counted_on_the_eval_line(tmp_path):
    # they were dropped with no word: the line said "1 rows" of an eval file of 3
    good = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in [good, {"messages": "Hi?"}, {"prompt": "Hi?"}]))
    recipe = load_recipe(write_recipe(tmp_path, dataset_name=ULTRACHAT, eval_strategy="steps", eval_steps=10,
                                      eval_datasets=[{"path": str(path), "dataset_format": "messages"}]))
    data = build_source_data(recipe, AutoTokenizer.from_pretrained(ensure_tiny("llama")))
    assert data.eval_dropped == {"missing_field": 1, "not_a_message_list": 1}
    assert describe_eval(data.eval, token_counts(data.eval), data.eval_left_out, dropped=data.eval_dropped) == (
        "[data] eval: 1 rows, 73 tokens, 5 supervised; 2 rows of eval_datasets dropped as read (missing_field 1, "
        "not_a_message_list 1)")


def test_streamed_packed_mixture_is_read_once_by_the_per_rank_and_worker_readers(tmp_path, monkeypatch):
    thinking = "data/samples/multilingual_thinking.jsonl"
    path = write_recipe(tmp_path, datasets=[{"path": ULTRACHAT, "fraction": 0.5},
                                            {"path": thinking, "dataset_format": "reasoning", "fraction": 0.5}],
                        streaming=True, pack_blocks=True, max_length=256, test_split_size=0.1, seed=3)
    recipe = load_recipe(path)
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny("qwen3_5"))
    data = build_source_data(recipe, tokenizer)
    key = lambda conversation: json.dumps(conversation, sort_keys=True)  # noqa: E731
    mixed = [key(row["messages"]) for row in data.train]
    assert mixed == [key(row["messages"]) for row in data.train]  # seeded: the same order every time

    # first_exhausted: the stream ends when its first source is used up, here all 84 reasoning training rows.
    reasoning = [row for row in mixed if "reasoning language" in row]
    assert not any(is_held_out({"messages": json.loads(row)}, 0.1) for row in mixed)  # eval rows never trained
    assert len(reasoning) == 100 - data.report.sources[1].eval_rows
    assert 0.35 < len(reasoning) / len(mixed) < 0.65

    # 2 ranks x 2 dataloader workers: four readers, disjoint, together the whole stream.
    read = []
    for rank in range(2):
        stream = RankLocalBlockStream(data.train, tokenizer, 256, rank=rank, world_size=2)
        for worker in range(2):
            monkeypatch.setattr("sft_recipes.data.blocks.get_worker_info",
                                lambda worker=worker: SimpleNamespace(id=worker, num_workers=2))
            read += [key(row["messages"]) for row in stream.reader_shard()]
    assert sorted(read) == sorted(mixed)


def test_map_style_packed_mixture_mixes_chat_formats_and_packs_eval_rows_whole(tmp_path):
    path = write_recipe(tmp_path, datasets=[{"path": ULTRACHAT, "fraction": 0.5},
                                            {"path": "data/samples/multilingual_thinking.jsonl",
                                             "dataset_format": "reasoning", "fraction": 0.5}],
                        pack_blocks=True, max_length=256, test_split_size=0.1)
    recipe = load_recipe(path)
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny("qwen3_5"))
    data = build_source_data(recipe, tokenizer)
    chat, reasoning = data.report.sources
    assert chat.mixture_rows == reasoning.mixture_rows == reasoning.available_rows == 100 - reasoning.eval_rows
    conversations = 0
    for block in RankLocalBlockStream(data.train, tokenizer, 256, rank=0, world_size=1):
        if block["stream_exhausted"]:
            break
        conversations += block["stream_stats"].conversations
    assert conversations == chat.mixture_rows + reasoning.mixture_rows
    # Eval conversations are packed whole: every segment of a block is one conversation, none split.
    segments = sum(len(lengths) for lengths in data.eval["seq_lengths"])
    assert segments == chat.eval_rows + reasoning.eval_rows
    assert all(sum(lengths) <= 256 for lengths in data.eval["seq_lengths"])
    # What the report says was read but not trained follows how the blocks are packed (`MixtureReport.format`)
    assert data.report.packing_window is None  # split_examples: the last conversations' parts past the last block
    whole = build_source_data(load_recipe(path, {"split_examples": False, "packing_window": 64}), tokenizer)
    assert whole.report.packing_window == 64  # whole conversations: those waiting in the packing window


def test_streamed_alpaca_and_text_are_tokenized_as_read_and_rows_cut_to_nothing_are_counted(tmp_path, monkeypatch):
    monkeypatch.setattr("sft_recipes.data.sources.STREAM_READS", {})
    alpaca = tmp_path / "alpaca.jsonl"
    long = " ".join(["word"] * 200)  # its prompt alone fills max_length: nothing of the answer is left
    alpaca.write_text("\n".join(json.dumps({"instruction": long if i % 2 else f"Say {i}.", "output": f"{i}"})
                                for i in range(10)) + "\n")
    text = tmp_path / "text.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"plain text {i}"}) for i in range(10)) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny("llama"))
    recipe = load_recipe(write_recipe(tmp_path, dataset_name=str(alpaca), dataset_format="alpaca",
                                      dataset_streaming=True, max_length=32))
    data = build_source_data(recipe, tokenizer)
    rows = list(data.train)
    assert len(rows) == 5 and all(set(row) == {"input_ids", "labels"} and len(row["input_ids"]) <= 32 for row in rows)
    assert all(any(label != -100 for label in row["labels"][1:]) for row in rows)
    callback = StreamedRowDropsCallback([source.checked for source in data.report.sources], max_dropped_share=0.6)
    callback.on_train_end(SimpleNamespace(device=torch.device("cpu")), None, None)
    (source,) = data.report.as_dict()["sources"]
    assert source["read_while_training"] == {"rows": 10, "dropped": {"no_trainable_tokens": 5}}

    recipe = load_recipe(write_recipe(tmp_path, streaming=True, max_length=32, mixture_strategy="all_exhausted",
                                      datasets=[{"path": str(alpaca), "dataset_format": "alpaca", "fraction": 0.5},
                                                {"path": str(text), "dataset_format": "text", "fraction": 0.5}]))
    mixed = list(build_source_data(recipe, tokenizer).train)
    decoded = [tokenizer.decode(row["input_ids"]) for row in mixed]
    assert any("plain text" in row for row in decoded) and any("Say" in row for row in decoded)


def test_a_packed_runs_report_says_how_many_conversations_the_steps_read_of_the_rows_available():
    # SmolLM2 demo numbers: 300 training rows, 6 steps read 59 conversations of them.
    from sft_recipes.data.blocks import SourceCounts, StreamStats
    from sft_recipes.data.report import MixtureReport, SourceReport

    report = MixtureReport(sources=[SourceReport(DataReport("chat.jsonl", rows=300), available_rows=300,
                                                 mixture_rows=300)], packed=True)
    assert "tokens counted while training" in report.format()
    read = SourceCounts(conversations=59, tokens=6200, supervised_tokens=3462)
    # The ranks' blocks held 3,441 of those supervised tokens (the demo's `[data] all 2 ranks trained on` line).
    report.count_stream(StreamStats(conversations=59, supervised_tokens=3441, sources={0: read}), stream_ended=False,
                        max_dropped_share=0.05)
    assert report.format().splitlines()[1:] == [
        "  read by the steps run: 59 conversations of 300 training rows, 6,200 tokens, 3,462 supervised "
        "(each conversation counted whole when read); eval rows 0",
        "[data] trained: 3,441 supervised tokens in the blocks the steps ran (as `all ranks trained on` says); the "
        "other 21 of the 3,462 read were in the last conversations' parts past the last block"]
    summary = report.as_dict()
    assert (summary["tokens"], summary["supervised_tokens"], summary["sources"][0]["conversations_read"],
            summary["supervised_tokens_in_trained_blocks"]) == (6200, 3462, 59, 3441)

    # Whole conversations (split_examples: false; the vision twin's 3 steps): the packer read ahead into its window,
    # so most of what was read waits there, not in a part of the last conversation.
    whole = MixtureReport(sources=[SourceReport(DataReport("shapes.jsonl", rows=60), available_rows=60,
                                                mixture_rows=60)], packed=True, packing_window=1024)
    read = SourceCounts(conversations=60, tokens=3085, supervised_tokens=1092)
    whole.count_stream(StreamStats(conversations=60, supervised_tokens=262, sources={0: read}), stream_ended=False,
                       max_dropped_share=0.05)
    assert whole.format().splitlines()[-1] == (
        "[data] trained: 262 supervised tokens in the blocks the steps ran (as `all ranks trained on` says); the other "
        "830 of the 1,092 read were in conversations still waiting to be packed when the steps ended (whole "
        "conversations are packed best-fit among up to packing_window=1,024 read ahead)")
