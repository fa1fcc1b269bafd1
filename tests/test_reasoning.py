"""Reasoning rows (Multilingual-Thinking) through the real GPT-OSS template: analysis channel, in the loss."""

from __future__ import annotations

import json

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from conftest import REPO_ROOT
from sft_recipes.config import load_recipe
from sft_recipes.data.masking import mask_conversations
from sft_recipes.data.formats import FORMATS, Tokenization
from sft_recipes.data.report import DataReport
from sft_recipes.data.reasoning import check_reasoning_is_trained, supervised_text
from sft_recipes.tiny import ensure_tiny

SAMPLES = REPO_ROOT / "data" / "samples" / "multilingual_thinking.jsonl"
ROW = {
    "messages": [
        {"role": "system", "content": "reasoning language: German\n\nBe brief.", "thinking": None},
        {"role": "user", "content": "Convert 3 minutes to seconds.", "thinking": None},
        {"role": "assistant", "content": "180 seconds.", "thinking": "Ich rechne: 3 x 60 = 180."},
    ]
}


@pytest.fixture(scope="module")
def gpt_oss_tokenizer():
    return AutoTokenizer.from_pretrained(ensure_tiny("gpt_oss"))  # the real openai/gpt-oss-120b template


@pytest.fixture(scope="module")
def llama_tokenizer():
    return AutoTokenizer.from_pretrained(ensure_tiny("llama"))  # its template never renders `thinking`


def test_reasoning_is_the_analysis_channel_and_is_trained(gpt_oss_tokenizer):
    [row] = mask_conversations(gpt_oss_tokenizer, [ROW["messages"]])
    assert supervised_text(gpt_oss_tokenizer, row.input_ids, row.assistant_masks) == (
        "<|channel|>analysis<|message|>Ich rechne: 3 x 60 = 180.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>180 seconds.<|return|>"
    )
    # The system prompt is the developer message, outside the loss like the user turn.
    assert "<|start|>developer<|message|># Instructions\n\nreasoning language: German\n\nBe brief.\n\n<|end|>" in row.text


def test_sample_rows_pass_the_check(gpt_oss_tokenizer):
    rows = [json.loads(line) for line in SAMPLES.read_text().splitlines()]
    assert check_reasoning_is_trained(rows, gpt_oss_tokenizer) == 64


def test_a_template_that_drops_reasoning_is_refused(llama_tokenizer):
    with pytest.raises(ValueError, match=r"does not put the assistant's reasoning into the trained tokens for 1 of 1"):
        check_reasoning_is_trained([ROW], llama_tokenizer)


def test_rows_without_reasoning_are_the_wrong_dataset(gpt_oss_tokenizer):
    plain = {"messages": [dict(message, thinking=None) for message in ROW["messages"]]}
    with pytest.raises(ValueError, match=r"rows \[1\] of the first 2 have none.*dataset_format: messages"):
        check_reasoning_is_trained([ROW, plain], gpt_oss_tokenizer)


def test_reasoning_format_prepares_masked_token_rows(gpt_oss_tokenizer):
    recipe = load_recipe(REPO_ROOT / "recipes" / "tiny" / "gptoss120b.yaml")
    fmt = FORMATS[recipe.data.dataset_format]
    dataset = fmt.prepare(Dataset.from_list([ROW, ROW]), gpt_oss_tokenizer,
                          Tokenization(max_length=recipe.training.max_length), DataReport("rows"))
    assert fmt.name == "reasoning" and dataset.column_names == ["input_ids", "assistant_masks"]
    first = dataset[0]
    assert "Ich rechne: 3 x 60 = 180." in supervised_text(gpt_oss_tokenizer, first["input_ids"], first["assistant_masks"])
