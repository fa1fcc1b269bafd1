"""The dataset shapes users bring besides `messages`: TRL's prompt/completion (strings, and conversational), and
ShareGPT `conversations: [{from, value}]` (LLaMA-Factory's, function calls included) with a source `mapping`."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml
from datasets import Dataset

from real_tokenizers import real_tokenizer
from sft_recipes.config import load_recipe
from sft_recipes.data.formats import FORMATS, Tokenization
from sft_recipes.data.rows import (
    MESSAGES_NOT_STRINGS,
    NO_ASSISTANT_TURN,
    NOT_A_MESSAGE_LIST,
    NOT_A_STRING,
    STRINGS_NOT_MESSAGES,
    UNKNOWN_ROLE,
    UNKNOWN_TOOL,
)
from sft_recipes.data.sources import load_checked_dataset
from sft_recipes.errors import RecipeError
from test_formats import tiny_llama  # noqa: F401  (fixture)
from test_tools import AREA, EXPECTED


def local(path, dataset_format, mapping=None):
    return SimpleNamespace(dataset_name=str(path), dataset_format=dataset_format, dataset_streaming=False,
                           dataset_train_split="train", dataset_config=None, dataset_revision=None,
                           max_train_samples=None, overlong_policy="truncate", pack_blocks=False,
                           chat_template_kwargs=None, dataset_mapping=mapping)


def write(tmp_path, rows):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def labelled(tokenizer, trained):
    return [tokenizer.decode([t for t in labels if t != -100]) for labels in trained["labels"]]


PROMPTS = [{"prompt": "The sky is", "completion": " blue."}, {"prompt": "2 + 2 =", "completion": " 4"}]


def test_prompt_completion_strings_are_tokenized_exactly_as_trl_tokenizes_them(tiny_llama, tmp_path):  # noqa: F811
    from trl import SFTConfig, SFTTrainer

    tokenizer, model = tiny_llama
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], max_length=128,
                     activation_checkpointing=False)
    trl_rows = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(PROMPTS),
                          processing_class=tokenizer).train_dataset
    rows, report = load_checked_dataset(local(write(tmp_path, PROMPTS + [{"prompt": "x", "completion": ["no"]}]),
                                              "prompt_completion"))
    assert report.dropped == {NOT_A_STRING: 1}
    ours = FORMATS["prompt_completion"].to_tokens(rows, tokenizer, Tokenization(max_length=128), report)
    for mine, theirs in zip(ours, trl_rows):
        assert mine["input_ids"] == theirs["input_ids"]
        assert mine["labels"] == theirs["labels"]
    assert labelled(tokenizer, ours) == [" blue." + tokenizer.eos_token, " 4" + tokenizer.eos_token]


def test_conversational_prompt_completion_trains_only_the_completions_replies(tmp_path):
    tokenizer = real_tokenizer("llama")
    rows = [
        {"prompt": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "5"},
                    {"role": "user", "content": "Check again."}],
         "completion": [{"role": "assistant", "content": "4"}]},
        {"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "user", "content": "Hi?"}]},
        {"prompt": "The sky is", "completion": " blue."},
        {"prompt": "The sky is", "completion": [{"role": "assistant", "content": "Blue."}]},  # neither shape
    ]
    data, report = load_checked_dataset(local(write(tmp_path, rows), "prompt_completion_chat"))
    # strings: prompt_completion's shape; a string beside a list was counted as not_a_string
    assert report.dropped == {NO_ASSISTANT_TURN: 1, STRINGS_NOT_MESSAGES: 1, NOT_A_MESSAGE_LIST: 1}
    fmt = FORMATS["prompt_completion_chat"]
    trained = fmt.to_tokens(fmt.as_trained(data), tokenizer, Tokenization(max_length=None), report)
    assert labelled(tokenizer, trained) == ["4<|eot_id|>"]  # the prompt's reply "5" is context only
    assert "5<|eot_id|>" in tokenizer.decode(trained[0]["input_ids"])


CHAT_PROMPTS = [{"prompt": [{"role": "user", "content": row["prompt"]}],
                 "completion": [{"role": "assistant", "content": row["completion"]}]} for row in PROMPTS]


@pytest.mark.parametrize(("given", "fits", "reason", "shape"), [
    ("prompt_completion_chat", "prompt_completion", STRINGS_NOT_MESSAGES, "strings"),
    ("prompt_completion", "prompt_completion_chat", MESSAGES_NOT_STRINGS, "message lists")])
def test_the_other_prompt_completion_shape_is_refused_naming_the_format_that_reads_it(given, fits, reason, shape,
                                                                                      tmp_path):
    """Two rows of the other shape and one of the given format's: refused by the drop share, naming the format."""
    wrong, right = (PROMPTS, CHAT_PROMPTS[:1]) if fits == "prompt_completion" else (CHAT_PROMPTS, PROMPTS[:1])
    _, report = load_checked_dataset(local(write(tmp_path, wrong + right), given))
    with pytest.raises(RecipeError) as refused:
        report.enforce(0.05)  # the recipe's max_dropped_share (default)
    message = str(refused.value)
    assert message.startswith("Refusing to train: 66.67% of the rows are bad, more than max_dropped_share=0.05 (")
    assert f"dropped 2 (66.67%: {reason} 2)" in message
    assert message.endswith(f"Prompt and completion are {shape}: set dataset_format: {fits}. Fix the rows, check "
                            "dataset_format, or raise max_dropped_share if dropping them is intended.")


SHAREGPT_TOOLS = {
    "conversations": [
        {"from": "human", "value": "Find the area of a triangle with a base of 10 units and height of 5 units."},
        {"from": "function_call", "value": json.dumps({"name": "calculate_triangle_area",
                                                       "arguments": {"base": 10, "height": 5}})},
        {"from": "observation", "value": '{"area": 25}'},
        {"from": "gpt", "value": "The area is 25 square units."},
    ],
    "system": "You are a helpful assistant.",
    "tools": json.dumps([AREA["function"]]),  # LLaMA-Factory: a JSON string of bare schemas
}


def test_sharegpt_with_function_calls_trains_as_the_same_tool_conversation(tmp_path):
    tokenizer = real_tokenizer("llama")
    unknown = json.loads(json.dumps(SHAREGPT_TOOLS))
    unknown["conversations"][1]["value"] = json.dumps({"name": "get_weather", "arguments": {}})
    rows = [SHAREGPT_TOOLS, unknown, {"conversations": [{"from": "bot", "value": "?"}]}, {"conversations": "Hi"}]
    data, report = load_checked_dataset(local(write(tmp_path, rows), "sharegpt"))
    assert report.dropped == {UNKNOWN_TOOL: 1, UNKNOWN_ROLE: 1, NOT_A_MESSAGE_LIST: 1}
    fmt = FORMATS["sharegpt"]
    trained = fmt.to_tokens(fmt.as_trained(data), tokenizer, Tokenization(max_length=None), report)
    assert labelled(tokenizer, trained) == ["".join(EXPECTED["llama"])]  # as the messages row of test_tools


def test_sharegpt_mapping_reads_other_names(tmp_path):
    tokenizer = real_tokenizer("qwen3")
    rows = [{"dialog": [{"speaker": "USER", "text": "Hi"}, {"speaker": "BOT", "text": "Hello!"}], "persona": "Be nice."}]
    mapping = {"messages": "dialog", "system": "persona", "role_tag": "speaker", "content_tag": "text",
               "user_tag": "USER", "assistant_tag": "BOT"}
    data, report = load_checked_dataset(local(write(tmp_path, rows), "sharegpt", mapping))
    fmt = FORMATS["sharegpt"]
    assert data[0]["messages"] == [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "Hello!"}]
    trained = fmt.to_tokens(fmt.as_trained(data), tokenizer, Tokenization(max_length=None), report)
    assert labelled(tokenizer, trained) == ["<think>\n\n</think>\n\nHello!<|im_end|>\n"]
    with pytest.raises(RecipeError, match="has no column"):  # without the mapping: the default names are missing
        load_checked_dataset(local(write(tmp_path, rows), "sharegpt"))


def test_a_mapping_is_checked_when_the_recipe_is_parsed(tmp_path):
    base = {"model_name_or_path": "tiny:llama", "output_dir": str(tmp_path / "out"), "use_cpu": True}
    cases = [
        ({"dataset_name": "x.jsonl", "dataset_format": "sharegpt", "dataset_mapping": {"user": "HUMAN"}},
         "dataset_mapping: mapping has no key 'user'; did you mean 'user_tag'?"),
        ({"dataset_name": "x.jsonl", "dataset_format": "messages", "dataset_mapping": {"messages": "dialog"}},
         "dataset_mapping: dataset_format messages takes no `mapping`"),
        ({"datasets": [{"path": "x.jsonl", "dataset_format": "sharegpt",
                        "mapping": {"user_tag": "gpt"}}]}, "two roles are mapped to the same tag"),
    ]
    for values, message in cases:
        (tmp_path / "r.yaml").write_text(yaml.safe_dump({**base, **values}))
        with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace("`", "`")):
            load_recipe(tmp_path / "r.yaml")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({**base, "datasets": [
        {"path": "x.jsonl", "dataset_format": "sharegpt", "mapping": {"messages": "dialog", "user_tag": "USER"}}]}))
    assert load_recipe(tmp_path / "r.yaml").data.datasets[0]["mapping"] == {"messages": "dialog", "user_tag": "USER"}


def test_prompt_completion_samples_are_asked_as_plain_text(tmp_path):
    from sft_recipes.reporting.samples import prompt_style, user_turn

    base = {"model_name_or_path": "tiny:llama", "output_dir": str(tmp_path / "out"), "use_cpu": True,
            "dataset_name": "x.jsonl"}
    styles = {}
    for dataset_format in ("prompt_completion", "prompt_completion_chat", "sharegpt", "text"):
        (tmp_path / "r.yaml").write_text(yaml.safe_dump({**base, "dataset_format": dataset_format}))
        styles[dataset_format] = prompt_style(load_recipe(tmp_path / "r.yaml").data)
    assert styles == {"prompt_completion": "text", "prompt_completion_chat": "chat", "sharegpt": "chat",
                      "text": "text"}
    assert user_turn(PROMPTS[0], "prompt_completion") == "The sky is"
