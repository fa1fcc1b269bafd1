"""`dataset_format: alpaca_chat`: alpaca rows trained as user/assistant conversations through the model's chat
template (assistant-only loss, packable), so a mixture of alpaca and chat sources trains one prompt style."""

from __future__ import annotations

import json

import yaml
from datasets import Dataset
from transformers import AutoTokenizer

from real_tokenizers import real_tokenizer
from sft_recipes.config import load_recipe
from sft_recipes.data.blocks import IGNORE_INDEX, RankLocalBlockStream
from sft_recipes.data.formats import FORMATS, Tokenization
from sft_recipes.data.report import DataReport
from sft_recipes.run import Run
from sft_recipes.run.data import source_data
from sft_recipes.tiny import ensure_tiny

ALPACA_ROWS = [
    {"instruction": "Add 2 and 3.", "input": "Answer with a digit.", "output": "5"},
    {"instruction": "Say hi.", "input": "", "output": "Hi!"},
]


def trained_rows(tokenizer, rows=ALPACA_ROWS):
    fmt = FORMATS["alpaca_chat"]
    conversations = fmt.as_trained(Dataset.from_list(rows))
    return conversations, fmt.to_tokens(conversations, tokenizer, Tokenization(max_length=512), DataReport(source="t"))


def test_alpaca_rows_become_user_assistant_conversations_input_after_the_instruction():
    conversations, _ = trained_rows(AutoTokenizer.from_pretrained(ensure_tiny("qwen3_5")))
    assert conversations.column_names == ["messages"]
    assert conversations["messages"] == [
        [{"role": "user", "content": "Add 2 and 3.\n\nAnswer with a digit."}, {"role": "assistant", "content": "5"}],
        [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}],
    ]


def test_qwen3_template_renders_the_row_and_trains_only_the_answer_and_end_of_turn():
    qwen3 = real_tokenizer("qwen3")
    _, tokens = trained_rows(qwen3)
    ids, labels = tokens[0]["input_ids"], tokens[0]["labels"]
    assert qwen3.decode(ids) == ("<|im_start|>user\nAdd 2 and 3.\n\nAnswer with a digit.<|im_end|>\n"
                                 "<|im_start|>assistant\n<think>\n\n</think>\n\n5<|im_end|>\n")
    supervised = [token for token in labels if token != IGNORE_INDEX]
    # The assistant turn as the template renders it: its (empty) think block, "5", <|im_end|>, "\n"
    assert supervised == [151667, 271, 151668, 271, 20, 151645, 198]
    assert qwen3.decode(supervised) == "<think>\n\n</think>\n\n5<|im_end|>\n"
    assert labels[:len(ids) - 7] == [IGNORE_INDEX] * (len(ids) - 7) and labels[-7:] == ids[-7:]


def test_llama3_template_trains_the_answer_and_eot_only(tmp_path):
    llama = real_tokenizer("llama")
    _, tokens = trained_rows(llama)
    ids, labels = tokens[1]["input_ids"], tokens[1]["labels"]
    text = llama.decode(ids)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert text.endswith("<|start_header_id|>user<|end_header_id|>\n\nSay hi.<|eot_id|>"
                         "<|start_header_id|>assistant<|end_header_id|>\n\nHi!<|eot_id|>")
    assert [token for token in labels if token != IGNORE_INDEX] == llama.convert_tokens_to_ids(["Hi", "!", "<|eot_id|>"])
    assert [token for token in labels if token != IGNORE_INDEX] == [13347, 0, 128009]


def test_a_packed_mixture_of_alpaca_chat_and_chat_sources_trains_one_prompt_style(tmp_path):
    values = {"model_name_or_path": "tiny:llama", "output_dir": str(tmp_path / "out"), "use_cpu": True, "bf16": False,
              "datasets": [{"path": "data/samples/alpaca.jsonl", "dataset_format": "alpaca_chat", "fraction": 0.5},
                           {"path": "data/samples/ultrachat.jsonl", "fraction": 0.5}],
              "pack_blocks": True, "max_length": 256}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(values))
    recipe = load_recipe(path)  # the linter takes alpaca_chat as a chat format: pack_blocks is allowed
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny("llama"))
    data = source_data(Run(recipe=recipe, source=None, batch_derivation=""), tokenizer)
    first = json.loads(open("data/samples/alpaca.jsonl").readline())
    rendered = [row["messages"] for row in data.train]
    expected_first = [{"role": "user", "content": first["instruction"] + (f"\n\n{first['input']}" if first["input"]
                                                                          else "")},
                      {"role": "assistant", "content": first["output"]}]
    assert expected_first in rendered  # the alpaca source is conversations, beside the chat source's
    assert not any("### Instruction" in turn["content"] for conversation in rendered for turn in conversation)
    alpaca, chat = data.report.sources
    conversations = 0
    for block in RankLocalBlockStream(data.train, tokenizer, 256, rank=0, world_size=1):
        if block["stream_exhausted"]:
            break
        conversations += block["stream_stats"].conversations
        ids, labels = block["input_ids"], block["labels"]
        trained = [token for token, label in zip(ids, labels) if label != IGNORE_INDEX]
        assert trained and len(trained) < len(ids)  # assistant-only loss inside every block
    assert conversations == alpaca.mixture_rows + chat.mixture_rows
