"""Exact masks with the real Llama-3 and Qwen3 tokenizers (tests/real_tokenizers.py) on the real templates,
for the conversations that used to be dropped: reasoning across several replies, consecutive replies, blank replies."""

from __future__ import annotations

import pytest

from real_tokenizers import real_tokenizer
from sft_recipes.data.masking import EMPTY_ASSISTANT_TURNS, KEPT, mask_conversations
from test_masking import runs


@pytest.fixture(scope="module")
def llama():
    return real_tokenizer("llama")


@pytest.fixture(scope="module")
def qwen3():
    return real_tokenizer("qwen3")


@pytest.fixture(scope="module")
def gpt_oss():
    return real_tokenizer("gpt_oss")


def masked_runs(tokenizer, chat, **template_kwargs):
    (row,) = mask_conversations(tokenizer, [chat], **template_kwargs)
    assert row.input_ids == tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False, **template_kwargs)
    return row, runs(tokenizer, row.input_ids, row.assistant_masks)


def test_real_tokenizers_are_the_real_vocabularies(llama, qwen3):
    assert llama.convert_tokens_to_ids(["<|begin_of_text|>", "<|eot_id|>"]) == [128000, 128009]
    assert qwen3.convert_tokens_to_ids(["<|im_end|>", "<think>", "</think>"]) == [151645, 151667, 151668]


@pytest.mark.parametrize("form", ["think_in_content", "reasoning_content"])
def test_qwen3_three_replies_with_reasoning_keep_each_turn_as_fully_rendered(qwen3, form):
    def reply(reasoning, answer):
        if form == "think_in_content":
            return {"role": "assistant", "content": f"<think>\n{reasoning}\n</think>\n\n{answer}"}
        return {"role": "assistant", "content": answer, "reasoning_content": reasoning}

    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        reply("Add two and two.", "4"),
        {"role": "user", "content": "And 3+3?"},
        reply("Add three and three.", "6"),
        {"role": "user", "content": "Thanks"},
        reply("Say welcome.", "You're welcome!"),
    ]
    row, supervised = masked_runs(qwen3, chat)
    assert row.drop_reason == KEPT and not row.used_prefix_renders
    assert supervised == [
        "4<|im_end|>\n",
        "6<|im_end|>\n",
        "<think>\nSay welcome.\n</think>\n\nYou're welcome!<|im_end|>\n",
    ]
    assert "Add two" not in row.text and "Add three" not in row.text  # earlier reasoning is not rendered
    assert (row.rerendered_turns, row.unrendered_reasoning_turns) == (2, 2)
    # Token span of the last turn: it starts right after the prompt header and runs to the end.
    last = row.turns[-1]
    assert qwen3.convert_ids_to_tokens(row.input_ids[last.token_start - 3 : last.token_start]) == [
        "<|im_start|>", "assistant", "Ċ"
    ]
    assert row.input_ids[last.token_start] == qwen3.convert_tokens_to_ids("<think>")
    assert (last.token_end, last.stop_token) == (len(row.input_ids), "<|im_end|>")


def test_qwen3_mixed_think_in_content_and_reasoning_content(qwen3):
    chat = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>greet</think>Hello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye.", "reasoning_content": "farewell"},
    ]
    row, supervised = masked_runs(qwen3, chat)
    assert supervised == ["Hello!<|im_end|>\n", "<think>\nfarewell\n</think>\n\nBye.<|im_end|>\n"]


def test_gpt_oss_two_consecutive_replies_with_thinking_are_both_supervised(gpt_oss):
    chat = [
        {"role": "user", "content": "Tell me two facts."},
        {"role": "assistant", "content": "Fact one.", "thinking": "first"},
        {"role": "assistant", "content": "Fact two.", "thinking": "second"},
    ]
    row, supervised = masked_runs(gpt_oss, chat, reasoning_effort="low")
    assert row.drop_reason == KEPT
    assert supervised == [
        "<|channel|>final<|message|>Fact one.<|end|>",
        "<|channel|>analysis<|message|>second<|end|><|start|>assistant<|channel|>final<|message|>Fact two.<|return|>",
    ]
    assert [turn.stop_token for turn in row.turns] == ["<|end|>", "<|return|>"]
    assert row.unrendered_reasoning_turns == 1  # harmony drops the earlier reply's analysis


def test_gpt_oss_consecutive_replies_after_a_user_turn_in_the_middle(gpt_oss):
    chat = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "assistant", "content": "A2"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A3", "thinking": "t3"},
    ]
    _, supervised = masked_runs(gpt_oss, chat)
    assert supervised == [
        "<|channel|>final<|message|>A1<|end|>",
        "<|channel|>final<|message|>A2<|end|>",
        "<|channel|>analysis<|message|>t3<|end|><|start|>assistant<|channel|>final<|message|>A3<|return|>",
    ]


# Qwen3 renders the reply verbatim; newlines merge with the header's "\n" into one prompt token.
@pytest.mark.parametrize(("reply", "qwen3_first_turn"), [("", "<|im_end|>\n"), (" ", " <|im_end|>\n"), ("\n\n", "<|im_end|>\n")])
def test_empty_and_blank_replies_follow_one_rule(llama, qwen3, reply, qwen3_first_turn):
    """An empty or whitespace-only reply trains only what the template writes for it (its stop token);
    a conversation whose every reply is empty or blank is dropped."""
    two_turns = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2"},
    ]
    row, supervised = masked_runs(llama, two_turns)
    assert supervised == ["<|eot_id|>", "A2<|eot_id|>"]  # Llama 3.1 trims the blank reply away
    assert row.empty_turns == 1
    row, supervised = masked_runs(qwen3, two_turns)
    assert supervised == [qwen3_first_turn, "<think>\n\n</think>\n\nA2<|im_end|>\n"]
    assert row.empty_turns == 1
    only_blank = two_turns[:2]
    for tokenizer in (llama, qwen3):
        (row,) = mask_conversations(tokenizer, [only_blank])
        assert (row.drop_reason, row.empty_turns, sum(row.assistant_masks)) == (EMPTY_ASSISTANT_TURNS, 1, 0)
