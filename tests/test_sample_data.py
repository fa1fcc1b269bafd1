"""The committed sample datasets: reproducible, in the real datasets' schemas, renderable by
the real chat templates, and with correct answers (a tiny model must be able to learn them)."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys

import pytest

from sft_recipes import tiny

from conftest import REALWORLD, REPO_ROOT, SHARED_REALWORLD

SAMPLES = REPO_ROOT / "data" / "samples"
REAL_ALPACA = REALWORLD / "data" / "tatsu-lab__alpaca.torchtune_alpaca_tiny.jsonl"
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)


def read_rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (SAMPLES / name).read_text(encoding="utf-8").splitlines()]


def alpaca_text(row: dict) -> str:
    prompt = PROMPT_WITH_INPUT if row["input"] else PROMPT_NO_INPUT
    return prompt.format(instruction=row["instruction"], input=row["input"]) + row["output"]


def test_committed_files_are_what_the_script_writes(tmp_path):
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "make_sample_data.py"), "--out-dir", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    written = sorted(path.name for path in tmp_path.iterdir())
    assert written == ["alpaca.jsonl", "glaive_toolcall.jsonl", "multilingual_thinking.jsonl", "ultrachat.jsonl"]
    for name in written:
        assert (tmp_path / name).read_bytes() == (SAMPLES / name).read_bytes(), f"{name} is stale: rerun the script"


def test_samples_stay_small():
    assert sum(path.stat().st_size for path in SAMPLES.glob("*.jsonl")) < 1_000_000


def test_alpaca_text_format_matches_the_real_dataset():
    # Anchors this test's prompt strings to real tatsu-lab/alpaca rows (both variants occur there).
    real_rows = [json.loads(line) for line in REAL_ALPACA.read_text().splitlines()]
    assert {bool(row["input"]) for row in real_rows} == {True, False}
    for row in real_rows:
        assert alpaca_text(row) == row["text"]


def test_alpaca_rows_have_the_real_columns():
    rows = read_rows("alpaca.jsonl")
    assert len(rows) == 300
    for row in rows:
        assert list(row) == ["instruction", "input", "output", "text"]
        assert all(isinstance(value, str) for value in row.values())
        assert row["instruction"] and row["output"]
        assert row["text"] == alpaca_text(row)
    with_input = sum(bool(row["input"]) for row in rows) / len(rows)
    assert 0.3 <= with_input <= 0.5


def test_ultrachat_rows_have_the_real_schema():
    rows = read_rows("ultrachat.jsonl")
    assert len(rows) == 200
    for row in rows:
        assert list(row) == ["prompt", "prompt_id", "messages"]
        assert row["prompt_id"] == hashlib.sha256(row["prompt"].encode("utf-8")).hexdigest()
        messages = row["messages"]
        assert all(set(message) == {"role", "content"} and message["content"] for message in messages)
        turns = messages[1:] if messages[0]["role"] == "system" else messages
        assert [message["role"] for message in turns] == ["user", "assistant"] * (len(turns) // 2)
        assert 1 <= len(turns) // 2 <= 4
        assert turns[0]["content"] == row["prompt"]
    assert any(row["messages"][0]["role"] == "system" for row in rows)
    assert {len(row["messages"]) for row in rows} >= {2, 4, 6, 8}


def test_multilingual_thinking_rows_have_the_real_schema():
    rows = read_rows("multilingual_thinking.jsonl")
    assert len(rows) == 100
    for row in rows:
        assert list(row) == ["reasoning_language", "developer", "user", "analysis", "final", "messages"]
        system, user, assistant = row["messages"]
        assert system == {
            "content": f"reasoning language: {row['reasoning_language']}\n\n{row['developer']}",
            "role": "system",
            "thinking": None,
        }
        assert user == {"content": row["user"], "role": "user", "thinking": None}
        assert assistant == {"content": row["final"], "role": "assistant", "thinking": row["analysis"]}
    assert len({row["reasoning_language"] for row in rows}) >= 4


def test_answers_are_correct():
    chats = [message for row in read_rows("ultrachat.jsonl") for message in row["messages"]]
    sums = 0
    for question, answer in zip(chats, chats[1:]):
        match = re.fullmatch(r"What is (\d+) \+ (\d+)\?", question["content"])
        if question["role"] == "user" and match:
            a, b = map(int, match.groups())
            assert answer["content"] == f"{a} + {b} = {a + b}."
            sums += 1
    sorts = 0
    for row in read_rows("alpaca.jsonl"):
        if row["instruction"] == "Sort the following numbers in ascending order.":
            numbers = [int(value) for value in row["input"].split(", ")]
            assert row["output"] == ", ".join(map(str, sorted(numbers)))
            sorts += 1
    assert sums and sorts


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_every_ultrachat_row_renders_with_the_chat_templates(family):
    tokenizer = tiny.build_tokenizer(family)
    rows = read_rows("ultrachat.jsonl")
    rendered = tokenizer.apply_chat_template([row["messages"] for row in rows], tokenize=False)
    for row, text in zip(rows, rendered):
        assert row["messages"][-1]["content"] in text


def test_every_thinking_row_renders_its_analysis_on_the_harmony_channel():
    tokenizer = tiny.build_tokenizer("gpt_oss")
    for row in read_rows("multilingual_thinking.jsonl"):
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        assert f"<|channel|>analysis<|message|>{row['analysis']}<|end|>" in text
        assert text.endswith(f"<|channel|>final<|message|>{row['final']}<|return|>")


@pytest.mark.parametrize("copy", sorted(p.relative_to(REALWORLD) for p in REALWORLD.rglob("*")
                                         if p.is_file() and p.suffix != ".md"), ids=str)
def test_realworld_copies_are_the_shared_files_byte_for_byte(copy):
    if not SHARED_REALWORLD.is_dir():
        pytest.skip(f"no team shared/ beside this clone to compare {copy} with")
    assert (REALWORLD / copy).read_bytes() == (SHARED_REALWORLD / copy).read_bytes()


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gpt_oss"])
def test_every_tool_row_is_read_and_trains_its_real_bfcl_call_on_each_template(family):
    from types import SimpleNamespace

    from sft_recipes.data.formats import FORMATS, Tokenization
    from sft_recipes.data.sources import load_checked_dataset

    args = SimpleNamespace(dataset_name=str(SAMPLES / "glaive_toolcall.jsonl"), dataset_format="sharegpt",
                           dataset_streaming=False, dataset_train_split="train", dataset_config=None,
                           dataset_revision=None, max_train_samples=None, overlong_policy="truncate",
                           pack_blocks=False, chat_template_kwargs=None)
    rows, report = load_checked_dataset(args)
    assert (report.rows, report.dropped) == (100, {})
    fmt = FORMATS["sharegpt"]
    trained = fmt.to_tokens(fmt.as_trained(rows), tiny.build_tokenizer(family), Tokenization(max_length=None), report)
    assert (len(trained), report.dropped) == (100, {})
    real = {json.loads(line)["question"][0][0]["content"]: json.loads(line)["ground_truth"][0]
            for name in ("simple_python", "multiple")
            for line in (REALWORLD / "tools" / f"gorilla__bfcl_v4.{name}.jsonl").read_text().splitlines()}
    calls = [row for row in read_rows("glaive_toolcall.jsonl") if row["tools"] != "[]"]
    assert len(calls) == 88
    for row in calls:
        ((function, accepted),) = real[row["conversations"][0]["value"]].items()
        call = json.loads(row["conversations"][1]["value"])
        assert call["name"] == function.replace(".", "_")
        assert all(value in accepted[key] for key, value in call["arguments"].items())
