"""The mask audit renders what training sees and sums it up honestly."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import TINY_LLAMA_RECIPE, run_command

from sft_recipes.data.audit import audit_masks, format_report, mark_supervised
from sft_recipes.data.masking import EMPTY_ASSISTANT_TURNS, NO_ASSISTANT_TURN, TRUNCATED_AWAY
from sft_recipes.tiny import build_tokenizer

LLAMA_SYSTEM_HEADER = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
)
GREETING = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
QUESTION_ONLY = [{"role": "user", "content": "Anyone?"}]
TWO_TURNS = [
    {"role": "user", "content": "Q1"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "Q2"},
    {"role": "assistant", "content": "A2"},
]


@pytest.fixture(scope="module")
def llama():
    return build_tokenizer("llama")


@pytest.fixture(scope="module")
def qwen3():
    return build_tokenizer("qwen3_5")


def token_count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_examples_mark_exactly_the_supervised_tokens(llama):
    report = audit_masks(llama, [GREETING, QUESTION_ONLY], n=2)
    kept, dropped = report.examples
    assert kept.marked_text == (
        LLAMA_SYSTEM_HEADER
        + "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        + "<|start_header_id|>assistant<|end_header_id|>\n\n[[Hello!<|eot_id|>]]"
    )
    assert dropped.drop_reason == NO_ASSISTANT_TURN
    assert "[[" not in dropped.marked_text


def test_totals_count_kept_tokens_and_drop_reasons(llama):
    report = audit_masks(llama, [GREETING, QUESTION_ONLY, GREETING], n=0)
    full_text = LLAMA_SYSTEM_HEADER + (
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
    )
    assert (report.conversations, report.kept, report.dropped) == (3, 2, {NO_ASSISTANT_TURN: 1})
    assert report.tokens == 2 * token_count(llama, full_text)
    assert report.supervised_tokens == 2 * token_count(llama, "Hello!<|eot_id|>")
    share = token_count(llama, "Hello!<|eot_id|>") / token_count(llama, full_text)
    assert report.supervised_share == pytest.approx(share)
    assert report.assistant_turns == 2 and report.every_turn_ends_with_stop_token
    assert report.examples == ()


def test_turns_cut_before_their_stop_token_are_reported(llama):
    header_tokens = token_count(
        llama, LLAMA_SYSTEM_HEADER + "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    report = audit_masks(llama, [GREETING, GREETING], n=1, max_length=header_tokens + 1)
    assert not report.every_turn_ends_with_stop_token
    assert report.turns_without_stop_token == ((0, 1), (1, 1))
    first_reply_token = llama.decode(llama("Hello!", add_special_tokens=False)["input_ids"][:1])
    assert report.examples[0].marked_text.endswith("<|end_header_id|>\n\n[[" + first_reply_token + "]]")
    text = format_report(report)
    assert "every one ends with its stop token: NO, 2 cut by max_length" in text
    assert "conversation 0 message 1, conversation 1 message 1" in text

    gone = audit_masks(llama, [GREETING], n=0, max_length=header_tokens)
    assert gone.dropped == {TRUNCATED_AWAY: 1} and gone.kept == 0 and gone.supervised_share == 0.0
    # it said "every one ends with its stop token: yes" of no turn at all
    assert format_report(gone).splitlines()[-1] == "assistant turns supervised: 0"


def test_report_names_rerendered_turns_and_unrendered_reasoning(qwen3):
    chat = [dict(m, reasoning_content="why") if m["role"] == "assistant" else m for m in TWO_TURNS]
    report = audit_masks(qwen3, [chat], n=1)
    assert report.rerendered_turns == 1 and report.unrendered_reasoning_turns == 1
    text = format_report(report)
    assert "assistant turns the template renders differently once later turns exist: 1" in text
    assert "assistant turns whose reasoning the template does not render (not trained on): 1" in text
    assert "=== example 0: kept" in text
    assert "<|im_start|>assistant\n[[A1<|im_end|>\n]]" in text


def test_format_report_summary_lines(llama):
    text = format_report(audit_masks(llama, [GREETING, QUESTION_ONLY], n=1))
    assert "conversations: 2, kept 1, dropped 1 (no_assistant_turn: 1)" in text
    assert "every one ends with its stop token: yes" in text
    assert "renders differently" not in text  # Llama 3.1 re-renders nothing


def test_mark_supervised_literal_runs(llama):
    ids = llama("ab cd", add_special_tokens=False)["input_ids"]
    pieces = [llama.decode([token]) for token in ids]
    mask = [0] * (len(ids) - 1) + [1]
    assert mark_supervised(llama, ids, mask) == "".join(pieces[:-1]) + "[[" + pieces[-1] + "]]"
    assert mark_supervised(llama, ids, [0] * len(ids)) == "ab cd"


def test_report_shows_formerly_dropped_reasoning_and_consecutive_replies_as_trained():
    qwen3 = build_tokenizer("qwen3_5")
    think_in_content = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>r1</think>A1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "<think>r2</think>A2"},
    ]
    report = audit_masks(qwen3, [think_in_content], n=1)
    assert (report.kept, report.assistant_turns, report.prefix_render_conversations) == (1, 2, 0)
    assert report.examples[0].marked_text.endswith(
        "<|im_start|>assistant\n[[A1<|im_end|>\n]]<|im_start|>user\nQ2<|im_end|>\n"
        "<|im_start|>assistant\n[[<think>\nr2\n</think>\n\nA2<|im_end|>\n]]"
    )
    gpt_oss = build_tokenizer("gpt_oss")
    consecutive = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A1", "thinking": "t1"},
        {"role": "assistant", "content": "A2", "thinking": "t2"},
    ]
    report = audit_masks(gpt_oss, [consecutive], n=1)
    assert (report.kept, report.assistant_turns, report.unrendered_reasoning_turns) == (1, 2, 1)
    assert report.examples[0].marked_text.endswith(
        "<|start|>assistant[[<|channel|>final<|message|>A1<|end|>]]<|start|>assistant"
        "[[<|channel|>analysis<|message|>t2<|end|><|start|>assistant<|channel|>final<|message|>A2<|return|>]]"
    )


def test_report_says_what_is_trained_of_empty_and_blank_replies(llama):
    blank_then_reply = [dict(m, content=" ") if m["content"] == "A1" else m for m in TWO_TURNS]
    empty_only = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": ""}]
    report = audit_masks(llama, [blank_then_reply, empty_only], n=1)
    assert report.dropped == {EMPTY_ASSISTANT_TURNS: 1} and report.empty_turns == 1
    text = format_report(report)
    assert "assistant turns with no text (empty or whitespace only): 1 (only their end-of-turn token is trained" in text
    assert "<|start_header_id|>assistant<|end_header_id|>\n\n[[<|eot_id|>]]" in text  # and that is what is marked


def test_audit_of_a_non_chat_recipe_is_one_error_line_naming_the_fix():
    result = run_command([sys.executable, "scripts/sft.py", str(TINY_LLAMA_RECIPE), "--audit-data", "2"])
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: --audit-data shows chat assistant masks")
    assert "dataset_format: alpaca (recipe)" in line
    assert "use it with a chat recipe" in line
    result = run_command([sys.executable, "scripts/sft.py", str(TINY_LLAMA_RECIPE), "--audit-data", "2",
                          "--dataset_name", "data/samples/ultrachat.jsonl", "--dataset_format", "text"])
    assert "has dataset_format: text (command line); use it with a chat recipe" in result.stderr


def test_audit_says_first_how_many_rows_were_read_and_dropped_before_the_conversations(tmp_path):
    # A row dropped as it is read never reaches the audited conversations: the audit said "conversations: 2, dropped 0"
    # for a file of 3 rows, one of them bad.
    rows = [{"messages": GREETING}, {"messages": TWO_TURNS},
            {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "Five."}]}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = run_command([sys.executable, "scripts/sft.py", "recipes/examples/tiny_llama_mixture.yaml", "--audit-data",
                          "3", "--datasets", "null", "--dataset_name", str(data), "--dataset_format", "messages"])
    assert result.returncode == 0, result.stderr[-2000:]
    read, first_bad, example = result.stdout.splitlines()[:3]
    assert read == f"[data] {data}: 3 rows read, kept 2, dropped 1 (33.33%: not_a_string 1), truncated 0"
    assert first_bad.startswith("  first not_a_string row, line 3: ")
    assert example.startswith("=== example 0: kept")
    assert "conversations: 2, kept 2, dropped 0 (none)" in result.stdout
