"""Bad rows are dropped by policy and counted per reason; too many, or nothing to learn, refuses to start."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from conftest import TINY_LLAMA_RECIPE, bin_path, run_command
from sft_recipes.data.formats import FORMATS, Tokenization, alpaca_to_prompt_completion
from sft_recipes.data.masking import tokenize_conversations
from sft_recipes.data.report import DataReport
from sft_recipes.errors import RecipeError
from sft_recipes.data.sources import load_checked_dataset
from sft_recipes.tiny import ensure_tiny

REAL_ALPACA = "tatsu-lab__alpaca.stanford_alpaca_pr152_subset300.jsonl"

BAD_ALPACA_LINES = [
    '{"instruction": "Name a color.", "output": "Blue"',  # invalid_json: cut short
    '["Name a color.", "Blue"]',  # invalid_json: not an object
    '{"instruction": "Name a color.", "input": ""}',  # missing_field: no output
    '{"instruction": "Name a color.", "output": null}',  # missing_field
    '{"instruction": "Name a color.", "output": ["Blue"]}',  # not_a_string
    '{"instruction": "Name a color.", "input": 5, "output": "Blue"}',  # not_a_string: input
    '{"instruction": "   ", "output": "Blue"}',  # empty_content
]


def data_args(path, dataset_format="alpaca", overlong_policy="truncate"):
    return SimpleNamespace(dataset_name=str(path), dataset_format=dataset_format, dataset_streaming=False,
                           dataset_train_split="train", dataset_config=None, dataset_revision=None,
                           max_train_samples=None, overlong_policy=overlong_policy, pack_blocks=False,
                           chat_template_kwargs=None)


@pytest.fixture
def alpaca_with_bad_lines(tmp_path, realworld):
    good = (realworld / "data" / REAL_ALPACA).read_text().splitlines()[:20]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(good[:10] + BAD_ALPACA_LINES + good[10:]) + "\n")
    return path, [json.loads(line) for line in good]


def test_every_bad_alpaca_row_is_counted_under_its_reason(alpaca_with_bad_lines):
    path, good = alpaca_with_bad_lines
    dataset, report = load_checked_dataset(data_args(path))
    assert dict(report.dropped) == {"invalid_json": 2, "missing_field": 2, "not_a_string": 2, "empty_content": 1}
    assert (report.rows, report.kept) == (27, 20)
    assert report.examples["invalid_json"] == 'line 11: {"instruction": "Name a color.", "output": "Blue"'
    assert report.examples["not_a_string"].startswith('line 15: {"instruction": "Name a color.", "output": ["Blue"]')
    assert dataset.to_list() == [{"input": row["input"], "instruction": row["instruction"], "output": row["output"]}
                                 for row in good]


def test_too_many_bad_rows_refuse_to_start_showing_one(alpaca_with_bad_lines):
    path, _ = alpaca_with_bad_lines
    _, report = load_checked_dataset(data_args(path))
    with pytest.raises(ValueError) as error:
        report.enforce(max_dropped_share=0.05)
    message = str(error.value)
    assert "25.93% of the rows are bad, more than max_dropped_share=0.05" in message
    assert 'first missing_field row, line 13: {"instruction": "Name a color.", "input": ""}' in message
    report.enforce(max_dropped_share=0.3)  # a higher share, chosen on purpose, is accepted


def test_every_bad_conversation_is_counted_under_its_reason(tmp_path):
    ask, reply = {"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}
    rows = [
        {"messages": [ask, reply]},
        {"messages": [{"role": "system", "content": ""}, ask, reply]},  # an empty system prompt is fine
        {"messages": [{"role": "bot", "content": "Hi?"}, reply]},  # unknown_role
        {"messages": [ask]},  # no_assistant_turn
        {"messages": [{"role": "user", "content": ""}, reply]},  # empty_content
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi?"}]}, reply]},  # not_a_string
        {"messages": [{"content": "Hi?"}, reply]},  # missing_field: role
        {"messages": [ask, {"role": "assistant"}]},  # missing_field: content
        {"messages": "Hi?"},  # not_a_message_list: the conversation itself
        {"prompt": "Hi?"},  # missing_field: messages
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    dataset, report = load_checked_dataset(data_args(path, "messages"))
    assert dict(report.dropped) == {"unknown_role": 1, "no_assistant_turn": 1, "empty_content": 1,
                                    "not_a_string": 1, "not_a_message_list": 1, "missing_field": 3}
    assert dataset["messages"] == [rows[0]["messages"], rows[1]["messages"]]


def test_all_bad_data_refuses_to_start(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(BAD_ALPACA_LINES) + "\n")
    with pytest.raises(ValueError, match="Refusing to train: no row is left"):
        load_checked_dataset(data_args(path))


def test_the_training_script_refuses_bad_data_before_loading_anything(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(BAD_ALPACA_LINES) + "\n")
    result = run_command([bin_path("python"), "scripts/sft.py", str(TINY_LLAMA_RECIPE),
                          "--dataset_name", str(path), "--output_dir", str(tmp_path / "out")])
    assert result.returncode != 0
    assert "Refusing to train: no row is left" in result.stderr
    assert 'first invalid_json row, line 1: {"instruction": "Name a color.", "output": "Blue"' in result.stderr


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_tiny("llama"))


@pytest.fixture(scope="module")
def trl_prepared(tokenizer, realworld, tmp_path_factory):
    """40 real alpaca rows, and what TRL itself makes of them without truncation (input_ids, labels)."""
    rows = [json.loads(line) for line in (realworld / "data" / REAL_ALPACA).read_text().splitlines()[:40]]
    raw = Dataset.from_list(rows)
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(ensure_tiny("llama")),
        args=SFTConfig(output_dir=str(tmp_path_factory.mktemp("trl")), max_length=None, use_cpu=True, bf16=False,
                       activation_checkpointing=False, report_to="none"),
        train_dataset=raw.map(alpaca_to_prompt_completion, remove_columns=raw.column_names),
        processing_class=tokenizer,
    )
    return raw, trainer.train_dataset


def test_length_policy_counts_what_trl_truncates_and_drops(tokenizer, trl_prepared):
    raw, prepared = trl_prepared
    prompt_lengths = [next(i for i, label in enumerate(labels) if label != -100) for labels in prepared["labels"]]
    max_length = sorted(prompt_lengths)[len(prompt_lengths) // 2]  # half the prompts alone fill it
    # What TRL keeps after its keep_start truncation, computed from TRL's own output:
    truncated = sum(len(ids) > max_length for ids in prepared["input_ids"])
    targets_left = [sum(label != -100 for label in labels[:max_length]) for labels in prepared["labels"]]
    assert 0 < targets_left.count(0) < len(raw) and truncated > targets_left.count(0)

    alpaca = FORMATS["alpaca"]
    report = DataReport("x")
    kept = alpaca.to_tokens(raw, tokenizer, Tokenization(max_length=max_length), report)
    assert dict(report.dropped) == {"no_trainable_tokens": targets_left.count(0)}
    assert report.truncated == truncated - targets_left.count(0)
    assert report.kept_supervised_tokens == sum(targets_left)  # TRL's prompt comes first: no labelled first token
    assert len(kept) == len(raw) - targets_left.count(0)
    # The rows kept are TRL's own, cut where TRL cuts them.
    assert kept["input_ids"] == [ids[:max_length] for ids, left in zip(prepared["input_ids"], targets_left) if left]
    assert kept["labels"] == [labels[:max_length] for labels, left in zip(prepared["labels"], targets_left) if left]

    report = DataReport("x")
    kept = alpaca.to_tokens(raw, tokenizer, Tokenization(max_length=max_length, overlong_policy="drop"), report)
    assert report.dropped["overlong"] == truncated
    assert len(kept) == len(raw) - truncated


def test_length_policy_measures_conversations_as_the_masking_renders_them(tokenizer):
    rows = [json.loads(line) for line in open("data/samples/ultrachat.jsonl").read().splitlines()[:30]]
    lengths = [len(ids) for ids in tokenize_conversations(tokenizer, [row["messages"] for row in rows])["input_ids"]]
    max_length = sorted(lengths)[len(lengths) // 2]
    report = DataReport("x")
    kept = FORMATS["messages"].prepare(Dataset.from_list([{"messages": row["messages"]} for row in rows]), tokenizer,
                                       Tokenization(max_length=max_length, overlong_policy="drop"), report)
    assert dict(report.dropped) == {"overlong": sum(length > max_length for length in lengths)}
    assert len(kept) == sum(length <= max_length for length in lengths)


def test_a_streamed_local_jsonl_skips_bad_lines_instead_of_failing(tmp_path, caplog):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    no_reply = {"messages": [{"role": "user", "content": "anyone?"}]}
    path = tmp_path / "chat.jsonl"
    lines = [json.dumps(good), "{not json", json.dumps(no_reply), json.dumps(good)] + [json.dumps(no_reply)] * 9
    path.write_text("\n".join(lines) + "\n")
    args = data_args(path, dataset_format="messages")
    args.dataset_streaming = True
    dataset, report = load_checked_dataset(args)
    with caplog.at_level("WARNING", logger="sft_recipes.data.sources"):
        assert report.streamed and [row["messages"] for row in dataset] == [good["messages"], good["messages"]]
    shown = [record.getMessage() for record in caplog.records]
    assert shown == [  # the 1st and the 10th of each reason, with the row
        f"[data] {path}: dropped streamed row (invalid_json, 1 so far in this reader), line 2: {{not json",
        f"[data] {path}: dropped streamed row (no_assistant_turn, 1 so far in this reader), line 3: {json.dumps(no_reply)}",
        f"[data] {path}: dropped streamed row (no_assistant_turn, 10 so far in this reader), line 13: {json.dumps(no_reply)}",
    ]


def test_a_streamed_hub_dataset_drops_and_shows_bad_rows(tmp_path, caplog, monkeypatch):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad = {"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    stream = Dataset.from_list([good, bad, good]).to_iterable_dataset()
    monkeypatch.setattr("sft_recipes.data.sources.load_raw_dataset", lambda args: stream)
    args = data_args("org/chat-data", dataset_format="messages")
    args.dataset_streaming = True
    dataset, report = load_checked_dataset(args)
    with caplog.at_level("WARNING", logger="sft_recipes.data.sources"):
        assert [row["messages"] for row in dataset] == [good["messages"]] * 2
    assert [record.getMessage() for record in caplog.records] == [
        f"[data] org/chat-data: dropped streamed row (unknown_role, 1 so far in this reader), a row: {json.dumps(bad)}"]


def test_conversations_dropped_while_masking_reach_the_data_report(tokenizer, tmp_path):
    ask, reply = {"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello there."}
    rows = [{"messages": [ask, reply]}] * 3 + [{"messages": [{"role": "user", "content": "why " * 200}, reply]}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = data_args(path, "messages")
    dataset, report = load_checked_dataset(args)
    assert not report.dropped  # structurally fine: only masking at max_length finds the last row empty
    short = len(tokenize_conversations(tokenizer, [rows[0]["messages"]])["input_ids"][0])
    prepared = FORMATS["messages"].prepare(dataset, tokenizer, Tokenization(max_length=short), report)
    assert dict(report.dropped) == {"truncated_away": 1} and report.kept == 3 == len(prepared)
    assert report.kept_supervised_tokens == sum(sum(masks[1:]) for masks in prepared["assistant_masks"]) > 0
    assert "truncated_away 1" in report.format() and "--audit-data" in report.format()


# ── Text that is not UTF-8 ───────────────────────────────────────────────────────────────────────

def latin1_line(instruction: str, output: str) -> bytes:
    return json.dumps({"instruction": instruction, "output": output}, ensure_ascii=False).encode("latin-1") + b"\n"


def test_a_line_that_is_not_utf8_is_a_counted_drop_with_its_line_number(alpaca_with_bad_lines, tmp_path):
    path, good = alpaca_with_bad_lines
    lines = path.read_bytes().splitlines(keepends=True)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(b"".join(lines[:2] + [latin1_line("Order a coffee.", "Un café, s'il vous plaît.")] + lines[2:]))
    dataset, report = load_checked_dataset(data_args(mixed))
    assert report.dropped["not_utf8"] == 1 and (report.rows, report.kept) == (28, 20)
    assert report.examples["not_utf8"] == 'line 3: {"instruction": "Order a coffee.", "output": "Un caf\\xe9, s\'il vous pla\\xeet."}'
    assert "\ufffd" not in json.dumps(dataset.to_list(), ensure_ascii=False)  # nothing trained on replacement characters
    streamed = data_args(mixed)
    streamed.dataset_streaming = True
    rows, _ = load_checked_dataset(streamed)
    assert len(list(rows)) == 20


def test_a_file_that_is_mostly_not_utf8_is_refused_naming_its_encoding(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(latin1_line("Say hi.", "Salut, ça va ?") * 3 + latin1_line("Say bye.", "Bye.") * 2)
    with pytest.raises(RecipeError) as error:
        load_checked_dataset(data_args(path))
    assert str(error.value) == (
        f"{path} (dataset_name) is not UTF-8: 3 of its first 5 lines cannot be decoded; it looks like Latin-1 / "
        f"Windows-1252 (cp1252). Convert it to UTF-8, e.g. `iconv -f cp1252 -t UTF-8 {path} > "
        f"{tmp_path / 'latin1'}.utf8.jsonl`, and point dataset_name at the converted file.")
    utf16 = tmp_path / "utf16.jsonl"
    utf16.write_bytes(('{"instruction": "Say hi.", "output": "Hi."}\n' * 3).encode("utf-16"))
    with pytest.raises(RecipeError, match="it looks like UTF-16. Convert it to UTF-8, e.g. `iconv -f UTF-16 "):
        load_checked_dataset(data_args(utf16))



def test_an_empty_jsonl_is_refused_as_empty_and_unreadable_lines_as_drops_not_as_missing_columns(tmp_path):
    # both were "has no column(s) ['messages'] ...; it has []. Pick the dataset_format ... or rename the columns"
    path = tmp_path / "train.jsonl"
    path.write_text("\n  \n")
    with pytest.raises(RecipeError) as error:
        load_checked_dataset(data_args(path, "messages"))
    assert str(error.value) == (f"{path} holds no row: it is empty (or blank lines only). Put one JSON object per line "
                                "in it, or point the recipe at the file that holds the rows.")
    streamed = SimpleNamespace(**{**vars(data_args(path, "messages")), "dataset_streaming": True})
    with pytest.raises(RecipeError) as streamed_error:  # was: "nothing to learn" once the packed stream ran dry
        load_checked_dataset(streamed, mark_bad_rows=True)
    assert str(streamed_error.value) == str(error.value)
    path.write_text("garbage\n[1, 2]\n")
    with pytest.raises(RecipeError) as error:
        load_checked_dataset(data_args(path, "messages"))
    assert str(error.value).startswith(f"Refusing to train: no row is left ({path}: 2 rows read, kept 0, dropped 2 "
                                       "(100.00%: invalid_json 2), truncated 0; first invalid_json row, line 1: garbage)")


def test_a_key_with_values_of_two_types_is_one_refusal_naming_it_not_an_arrow_traceback(tmp_path):
    ask, reply = {"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}
    rows = [{"messages": [{**ask, "meta": 1}, reply]}, {"messages": [ask, reply]},
            {"messages": [{**ask, "meta": "x"}, reply]}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(RecipeError) as error:
        load_checked_dataset(data_args(path, "messages"))
    assert str(error.value) == (f"{path}: `messages[].meta` holds values of different types (a number on line 1, a "
                                "string on line 3), and a column holds one type. Give `messages[].meta` one type in "
                                "every row, or remove it from the rows.")


@pytest.mark.parametrize("name, content, cause", [
    ("train.csv", b"", "No columns to parse from file"),
    ("train.json", b"[]", 'Instruction "train" corresponds to no data!'),
    ("train.parquet", b"not parquet", "Parquet magic bytes not found in footer. Either the file is corrupted or this "
                                      "is not a parquet file"),
])
def test_a_local_file_datasets_cannot_read_is_one_refusal_with_its_cause(tmp_path, name, content, cause):
    # each was a DatasetGenerationError or ArrowInvalid traceback
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(RecipeError) as error:
        load_checked_dataset(data_args(path, "messages"))
    assert str(error.value) == (f"Cannot read the rows of {path} ({cause}). Fix the file, or write the rows as .jsonl "
                                "(one JSON object per line: a bad line is then a counted drop, not a failed file).")

# ── A dataset path that is a folder ─────────────────────────────────────────────────────────────

def test_a_folder_without_data_files_is_refused_saying_what_it_holds(tmp_path):
    empty = tmp_path / "data.jsonl"  # `mkdir data.jsonl`: a folder named like a file
    empty.mkdir()
    with pytest.raises(RecipeError) as error:
        load_checked_dataset(data_args(empty))
    assert str(error.value) == (
        f"{empty} (dataset_name) is a folder with no data file: it is empty. Point dataset_name at a data file (e.g. "
        "train.jsonl), or put the rows in .json/.jsonl/.ndjson/.parquet/.csv/.tsv/.arrow files in that folder.")
    (empty / "notes.txt").write_text("to do\n")
    with pytest.raises(RecipeError, match=r"data.jsonl \(dataset_name\) is a folder with no data file: it holds notes.txt\. "):
        load_checked_dataset(data_args(empty))


def test_a_folder_of_data_files_with_a_stray_file_is_refused_naming_it(tmp_path):
    folder = tmp_path / "chat"
    (folder / "part").mkdir(parents=True)
    rows = '{"instruction": "Say hi.", "output": "Hi."}\n' * 3
    (folder / "part" / "train.jsonl").write_text(rows)
    (folder / "README.md").write_text("# my data\n")  # a dataset card is not rows
    (folder / ".notes.swp").write_text("x")  # nor are hidden files
    dataset, report = load_checked_dataset(data_args(folder))
    assert (len(dataset), report.rows) == (3, 3)
    (folder / "notes.txt").write_text("to do\n")
    with pytest.raises(RecipeError) as error:
        load_checked_dataset(data_args(folder))
    assert str(error.value) == (
        f"{folder} (dataset_name) is a folder of 1 data file(s) (part/train.jsonl) and notes.txt, which are not rows "
        "(.json/.jsonl/.ndjson/.parquet/.csv/.tsv/.arrow): move them out of the folder, or point dataset_name at the "
        "data file itself.")


def test_a_folder_without_the_split_asked_for_names_its_splits_not_a_bad_file(tmp_path):
    folder = tmp_path / "chat"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"instruction": "Say hi.", "output": "Hi."}\n' * 3)
    asked = SimpleNamespace(**{**vars(data_args(folder)), "dataset_train_split": "validation"})
    with pytest.raises(RecipeError) as error:  # was: "Cannot read the rows of ... Fix the file, or write ... .jsonl"
        load_checked_dataset(asked)
    assert str(error.value) == (
        f"{folder}: Unknown split \"validation\". Should be one of ['train']: set dataset_train_split (a `datasets:` "
        "entry's split) to one of them; a folder's file names give its splits (train.jsonl: train).")


# ── Empty replies: one rule, the masking's, for rows and masks alike ───────────────────────────

def test_an_empty_reply_is_kept_by_the_row_rules_and_trains_its_end_of_turn(tokenizer, tmp_path):
    hi, empty = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}
    question, answer = {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}
    rows = [{"messages": [hi, empty, question, answer]}, {"messages": [hi, empty]},
            {"messages": [{"role": "user", "content": ""}, answer]}]  # an empty question is still a broken row
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    dataset, report = load_checked_dataset(data_args(path, "messages"))
    assert dict(report.dropped) == {"empty_content": 1} and dataset["messages"] == [rows[0]["messages"],
                                                                                  rows[1]["messages"]]
    prepared = FORMATS["messages"].prepare(dataset, tokenizer, Tokenization(max_length=256), report)
    assert dict(report.dropped) == {"empty_content": 1, "empty_assistant_turns": 1}  # every reply empty: nothing to learn
    (ids,), (mask,) = prepared["input_ids"], prepared["assistant_masks"]
    supervised = tokenizer.decode([token for token, keep in zip(ids, mask) if keep])
    assert supervised == "<|eot_id|>A<|eot_id|>"  # the empty reply's end of turn, then the answer


def test_every_row_dropped_is_one_refusal_line_not_a_traceback(tmp_path):
    """max_length below every row with overlong_policy: drop leaves an empty dataset without columns."""
    result = run_command([bin_path("python"), "scripts/sft.py", str(TINY_LLAMA_RECIPE), "--max_length", "16",
                          "--overlong_policy", "drop", "--output_dir", str(tmp_path / "out")])
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: Refusing to train: no row is left (")
    assert "dropped 300 (100.00%: overlong 300)" in errors[0] and "first overlong row, row 0" in errors[0]
    assert "Traceback" not in result.stderr
