"""Tool-calling conversations (`data/tools.py`, `masking.py`): exact masks on the real Llama-3.1, Qwen3 and
gpt-oss templates with the real tokenizers, the row rules as counted drops, the template refusal, the mask
audit, and packing / mixing with other chat sources. The tool schemas and questions are BFCL v4's
(`shared/realworld/tools/`, simple_python_0 and parallel_0), the conversations around them our own."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from real_tokenizers import real_tokenizer
from sft_recipes.data.audit import audit_dataset, format_report
from sft_recipes.data.blocks import RankLocalBlockStream
from sft_recipes.data.formats import FORMATS, Tokenization
from sft_recipes.data.masking import KEPT, SEVERAL_TOOL_CALLS, check_renders_tools, mask_conversations
from sft_recipes.data.report import DataReport
from sft_recipes.data.rows import (
    INVALID_TOOL_ARGUMENTS,
    INVALID_TOOL_CALL,
    INVALID_TOOLS,
    ORPHAN_TOOL_RESULT,
    UNKNOWN_TOOL,
)
from sft_recipes.data.sources import load_checked_dataset
from sft_recipes.data.tools import stored_conversation
from sft_recipes.errors import RecipeError
from sft_recipes.tiny import REALWORLD_DIR, ensure_tiny
from test_masking import runs

AREA = {"type": "function", "function": {
    "name": "calculate_triangle_area", "description": "Calculate the area of a triangle given its base and height.",
    "parameters": {"type": "object", "properties": {
        "base": {"type": "integer", "description": "The base of the triangle."},
        "height": {"type": "integer", "description": "The height of the triangle."}}, "required": ["base", "height"]}}}
PLAY = {"type": "function", "function": {
    "name": "spotify_play", "description": "Play specific tracks from a given artist for a specific time duration.",
    "parameters": {"type": "object", "properties": {
        "artist": {"type": "string", "description": "The artist whose songs you want to play."},
        "duration": {"type": "integer", "description": "The duration for which the songs should be played."}},
        "required": ["artist", "duration"]}}}


def call(name: str, arguments, call_id: str | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}, **({"id": call_id} if call_id else {})}


# Arguments as a JSON string (OpenAI's wire shape), content None: what tool datasets store.
AREA_CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Find the area of a triangle with a base of 10 units and height of 5 units."},
    {"role": "assistant", "content": None, "tool_calls": [call("calculate_triangle_area", '{"base": 10, "height": 5}',
                                                                "call_1")]},
    {"role": "tool", "tool_call_id": "call_1", "name": "calculate_triangle_area", "content": '{"area": 25}'},
    {"role": "assistant", "content": "The area is 25 square units."},
]
EXPECTED = {
    "llama": ['{"name": "calculate_triangle_area", "parameters": {"base": 10, "height": 5}}<|eot_id|>',
              "The area is 25 square units.<|eot_id|>"],
    "qwen3": ['<tool_call>\n{"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5}}\n'
              "</tool_call><|im_end|>\n",
              "<think>\n\n</think>\n\nThe area is 25 square units.<|im_end|>\n"],
    "gpt_oss": [' to=functions.calculate_triangle_area<|channel|>commentary json<|message|>{"base": 10, "height": 5}'
                "<|call|>",
                "<|channel|>final<|message|>The area is 25 square units.<|return|>"],
}
PLAY_CHAT = [
    {"role": "user", "content": "Play songs from Taylor Swift and Maroon 5, for 20 and 15 minutes, on Spotify."},
    {"role": "assistant", "content": "", "tool_calls": [call("spotify_play", {"artist": "Taylor Swift", "duration": 20}),
                                                        call("spotify_play", {"artist": "Maroon 5", "duration": 15})]},
    {"role": "tool", "content": "playing"},
    {"role": "tool", "content": "playing"},
    {"role": "assistant", "content": "Both are playing."},
]


@pytest.fixture(scope="module", params=["llama", "qwen3", "gpt_oss"])
def family(request):
    return request.param, real_tokenizer(request.param)


def as_apply_chat_template_sees_it(chat):
    """The conversation with its arguments as objects, content "" where None: apply_chat_template's input."""
    chat = json.loads(json.dumps(chat))
    for message in chat:
        for tool_call in message.get("tool_calls") or ():
            if isinstance(tool_call["function"]["arguments"], str):
                tool_call["function"]["arguments"] = json.loads(tool_call["function"]["arguments"])
        if message["role"] == "assistant" and message["content"] is None:
            message["content"] = ""
    return chat


def test_bfcl_schemas_are_the_real_ones():
    (row,) = [json.loads(line) for line in (REALWORLD_DIR / "tools" / "gorilla__bfcl_v4.simple_python.jsonl")
              .read_text().splitlines()[:1]]
    assert row["function"][0]["description"] == AREA["function"]["description"]
    assert row["question"][0][0]["content"] == AREA_CHAT[1]["content"]


def test_every_assistant_turn_with_its_call_and_stop_token_is_trained_exactly(family):
    name, tokenizer = family
    (row,) = mask_conversations(tokenizer, [stored_conversation(AREA_CHAT, [AREA])])
    assert row.drop_reason == KEPT and not row.used_prefix_renders
    assert runs(tokenizer, row.input_ids, row.assistant_masks) == EXPECTED[name]
    # The very tokens the model's own template gives, tools= included: definitions, results, system, user untrained.
    assert row.input_ids == tokenizer.apply_chat_template(as_apply_chat_template_sees_it(AREA_CHAT), tools=[AREA],
                                                          tokenize=True, return_dict=False)
    untrained = tokenizer.decode([t for t, bit in zip(row.input_ids, row.assistant_masks) if not bit])
    assert "Calculate the area of a triangle" in untrained and "25" in untrained and "helpful" in untrained


def test_arguments_as_a_json_string_or_an_object_train_the_same_tokens(family):
    _, tokenizer = family
    as_object = as_apply_chat_template_sees_it(AREA_CHAT)
    bare_tool = AREA["function"]  # {name, description, parameters}: wrapped into the OpenAI shape
    parameters_as_a_string = {**bare_tool, "parameters": json.dumps(bare_tool["parameters"])}  # as some datasets store
    rows = mask_conversations(tokenizer, [stored_conversation(AREA_CHAT, [AREA]),
                                          stored_conversation(as_object, json.dumps([bare_tool])),
                                          stored_conversation(as_object, [parameters_as_a_string])])
    for row in rows[1:]:
        assert row.input_ids == rows[0].input_ids and row.assistant_masks == rows[0].assistant_masks


def test_several_calls_in_one_message(family):
    """Qwen3 renders them all in one turn; Llama-3.1 (raises) and gpt-oss (renders only the first) take one per
    message: such a conversation is dropped as several_tool_calls, never split into turns the data never had."""
    name, tokenizer = family
    (row,) = mask_conversations(tokenizer, [stored_conversation(PLAY_CHAT, [PLAY])])
    if name != "qwen3":
        assert row.drop_reason == SEVERAL_TOOL_CALLS and row.input_ids == []
        return
    assert row.drop_reason == KEPT
    assert runs(tokenizer, row.input_ids, row.assistant_masks) == [
        '<tool_call>\n{"name": "spotify_play", "arguments": {"artist": "Taylor Swift", "duration": 20}}\n</tool_call>\n'
        '<tool_call>\n{"name": "spotify_play", "arguments": {"artist": "Maroon 5", "duration": 15}}\n</tool_call>'
        "<|im_end|>\n",
        "<think>\n\n</think>\n\nBoth are playing.<|im_end|>\n",
    ]


def test_gpt_oss_reasoning_before_a_call_is_trained_with_the_call():
    tokenizer = real_tokenizer("gpt_oss")
    chat = [AREA_CHAT[1], {"role": "assistant", "thinking": "Base 10, height 5.",
                           "tool_calls": [call("calculate_triangle_area", {"base": 10, "height": 5})]}]
    (row,) = mask_conversations(tokenizer, [stored_conversation(chat, [AREA])])
    assert runs(tokenizer, row.input_ids, row.assistant_masks) == [
        "<|channel|>analysis<|message|>Base 10, height 5.<|end|><|start|>assistant to=functions.calculate_triangle_area"
        '<|channel|>commentary json<|message|>{"base": 10, "height": 5}<|call|>']


@pytest.mark.parametrize(("change", "reason"), [
    (lambda chat: chat[2]["tool_calls"][0]["function"].update(name="get_weather"), UNKNOWN_TOOL),
    (lambda chat: chat[2]["tool_calls"][0]["function"].update(arguments='{"base": 10,'), INVALID_TOOL_ARGUMENTS),
    (lambda chat: chat[2]["tool_calls"][0]["function"].update(arguments="[10, 5]"), INVALID_TOOL_ARGUMENTS),
    (lambda chat: chat[2]["tool_calls"][0].pop("function"), INVALID_TOOL_CALL),
    (lambda chat: chat.insert(2, {"role": "tool", "content": "25"}), ORPHAN_TOOL_RESULT),
    (lambda chat: chat[3].update(tool_call_id="call_9"), ORPHAN_TOOL_RESULT),
])
def test_row_rules_drop_with_a_reason(change, reason):
    chat = json.loads(json.dumps(AREA_CHAT))
    change(chat)
    fmt = FORMATS["messages"]
    assert fmt.row_problem({"messages": AREA_CHAT, "tools": [AREA]}) is None
    assert fmt.row_problem({"messages": chat, "tools": [AREA]}) == reason


def test_tools_that_are_not_schemas_and_calls_without_tools_are_dropped():
    fmt = FORMATS["messages"]
    assert fmt.row_problem({"messages": AREA_CHAT, "tools": "not json"}) == INVALID_TOOLS
    assert fmt.row_problem({"messages": AREA_CHAT, "tools": [{"description": "no name"}]}) == INVALID_TOOLS
    for parameters in ("{'base': 'number'}", "number", ["base", "height"]):  # not a JSON object, nor a string of one
        tool = {**AREA, "function": {**AREA["function"], "parameters": parameters}}
        assert fmt.row_problem({"messages": AREA_CHAT, "tools": [tool]}) == INVALID_TOOLS, parameters
    assert fmt.row_problem({"messages": AREA_CHAT}) == UNKNOWN_TOOL  # a call to a tool no row defines
    assert fmt.row_problem({"messages": AREA_CHAT[:2] + AREA_CHAT[4:], "tools": json.dumps([AREA])}) is None


def test_a_template_that_renders_no_tool_calls_is_refused_up_front(tmp_path):
    tokenizer = real_tokenizer("qwen3")
    tokenizer.chat_template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    with pytest.raises(ValueError, match="renders no tool definitions or no assistant tool_calls"):
        check_renders_tools(tokenizer)
    rows, _ = load_checked_dataset(local_args(tool_file(tmp_path)))
    with pytest.raises(RecipeError, match="^This source has tool-calling rows. The chat template renders no tool"):
        FORMATS["messages"].prepare(FORMATS["messages"].as_trained(rows), tokenizer, Tokenization(None), DataReport("tools"))
    for template in ("llama", "qwen3", "gpt_oss"):
        check_renders_tools(real_tokenizer(template))


def local_args(path, dataset_format="messages"):
    return SimpleNamespace(dataset_name=str(path), dataset_format=dataset_format, dataset_streaming=False,
                           dataset_train_split="train", dataset_config=None, dataset_revision=None,
                           max_train_samples=None, overlong_policy="truncate", pack_blocks=False,
                           chat_template_kwargs=None)


def tool_file(folder):
    """A tool source as users bring one: tools as a list or a JSON string, rows with and without calls, bad rows."""
    unknown = json.loads(json.dumps(AREA_CHAT))
    unknown[2]["tool_calls"][0]["function"]["name"] = "get_weather"
    bad_arguments = json.loads(json.dumps(AREA_CHAT))
    bad_arguments[2]["tool_calls"][0]["function"]["arguments"] = "{base: 10}"
    rows = [
        {"messages": AREA_CHAT, "tools": [AREA]},
        {"messages": PLAY_CHAT, "tools": json.dumps([PLAY])},
        {"messages": [AREA_CHAT[1], {"role": "assistant", "content": "It is 25 square units."}]},
        {"messages": unknown, "tools": [AREA]},
        {"messages": bad_arguments, "tools": [AREA]},
        {"messages": [AREA_CHAT[1], AREA_CHAT[3], AREA_CHAT[4]], "tools": [AREA]},
    ]
    path = folder / "tools.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_tool_file_is_read_with_counted_drops_and_trained_with_labels_on_the_calls(tmp_path):
    tokenizer = real_tokenizer("llama")
    rows, report = load_checked_dataset(local_args(tool_file(tmp_path)))
    assert report.dropped == {UNKNOWN_TOOL: 1, INVALID_TOOL_ARGUMENTS: 1, ORPHAN_TOOL_RESULT: 1}
    trained = FORMATS["messages"].to_tokens(FORMATS["messages"].as_trained(rows), tokenizer,
                                            Tokenization(max_length=None), report)
    assert report.dropped == {UNKNOWN_TOOL: 1, INVALID_TOOL_ARGUMENTS: 1, ORPHAN_TOOL_RESULT: 1, SEVERAL_TOOL_CALLS: 1}
    assert len(trained) == 2
    labelled = [tokenizer.decode([t for t in labels if t != -100]) for labels in trained["labels"]]
    assert labelled == ["".join(EXPECTED["llama"]), "It is 25 square units.<|eot_id|>"]


def test_the_audit_marks_the_trained_tool_call(tmp_path):
    tokenizer = real_tokenizer("qwen3")
    rows, _ = load_checked_dataset(local_args(tool_file(tmp_path)))
    text = format_report(audit_dataset(FORMATS["messages"].as_trained(rows), tokenizer, n=1))
    assert ('<|im_start|>assistant\n[[<tool_call>\n{"name": "calculate_triangle_area", "arguments": '
            '{"base": 10, "height": 5}}\n</tool_call><|im_end|>\n]]<|im_start|>user\n<tool_response>\n'
            '{"area": 25}\n</tool_response><|im_end|>') in text


def test_tool_rows_pack_block_diagonally_and_mix_with_plain_chat(tmp_path):
    from test_mixture import build_source_data, write_recipe

    from sft_recipes.config import load_recipe

    path = write_recipe(tmp_path, datasets=[{"path": str(tool_file(tmp_path))}, {"path": "data/samples/ultrachat.jsonl"}],
                        pack_blocks=True, max_length=512, max_dropped_share=0.9)
    recipe = load_recipe(path)
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny("qwen3_5"))  # the real Qwen3 template
    data = build_source_data(recipe, tokenizer)
    assert [source.checked.dropped for source in data.report.sources] == [
        {UNKNOWN_TOOL: 1, INVALID_TOOL_ARGUMENTS: 1, ORPHAN_TOOL_RESULT: 1}, {}]
    stream = RankLocalBlockStream(data.train, tokenizer, 512, rank=0, world_size=1, num_sources=2)
    blocks = []
    for block in stream:
        if block.get("stream_exhausted"):
            break
        blocks.append(block)
    for block in blocks:  # each conversation its own segment (block-diagonal attention); all full but the last
        assert sum(block["seq_lengths"]) == len(block["input_ids"])
        assert len(block["input_ids"]) == 512 or block is blocks[-1]
    trained = [tokenizer.decode([t for t in block["labels"] if t != -100]) for block in blocks]
    calls = "".join(trained).count("</tool_call><|im_end|>")
    assert calls == 2  # the area call and the two parallel plays (one turn); the bad rows never reach a block
    assert not any("<tool_response>" in text or "Calculate the area of a triangle" in text for text in trained)
    assert sum(text.count("<|im_end|>") for text in trained) > calls  # ultrachat's replies share the blocks


def test_a_streamed_tool_source_is_packed_with_its_drops_counted_by_the_reader(tmp_path):
    from test_mixture import build_source_data, write_recipe

    from sft_recipes.config import load_recipe

    path = write_recipe(tmp_path, dataset_name=str(tool_file(tmp_path)), dataset_format="messages", streaming=True,
                        pack_blocks=True, max_length=512, max_dropped_share=0.9)
    tokenizer = real_tokenizer("llama")
    data = build_source_data(load_recipe(path), tokenizer)
    stream = RankLocalBlockStream(data.train, tokenizer, 512, rank=0, world_size=1)
    blocks = []
    for block in stream:
        blocks.append(block)
        if block.get("stream_exhausted"):
            break
    read = blocks[0]["stream_stats"]
    for block in blocks[1:]:
        read = read.add(block["stream_stats"])
    assert read.sources[0].dropped == {UNKNOWN_TOOL: 1, INVALID_TOOL_ARGUMENTS: 1, ORPHAN_TOOL_RESULT: 1,
                                       SEVERAL_TOOL_CALLS: 1}
    trained = "".join(tokenizer.decode([t for t in block["labels"] if t != -100]) for block in blocks)
    assert trained == "".join(EXPECTED["llama"]) + "It is 25 square units.<|eot_id|>"


@pytest.mark.fsdp
def test_two_process_packed_run_on_tool_rows(tmp_path):
    from conftest import REPO_ROOT, launch_sft, read_summary

    out = tmp_path / "run"
    launch_sft(REPO_ROOT / "recipes" / "examples" / "tiny_llama_tools.yaml", "--max_steps", "4", "--eval_steps", "4",
               "--save_steps", "100", "--report_to", "none", "--sample_prompts", "[]", "--output_dir", str(out))
    summary = read_summary(out)
    assert list(summary["losses"]) == ["1", "2", "3", "4"] and set(summary["eval_losses"]) == {"4"}
    assert math.isfinite(summary["eval_losses"]["4"])  # at max_length 1024 no held-out answer was in a block: nan
    report = json.loads((out / "data_report.json").read_text())
    (source,) = report["sources"]
    assert (source["rows"], source["dropped"], source["eval_rows"]) == (100, {}, 3)  # test_split_size 0.05, by hash


@pytest.mark.slow
def test_a_model_whose_template_renders_no_tools_is_refused_with_one_error_line(tmp_path):
    import shutil

    import sys

    from conftest import run_command

    model = tmp_path / "model"
    shutil.copytree(ensure_tiny("llama"), model)
    (model / "chat_template.jinja").write_text(  # a plain template that ignores tools and tool_calls
        "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
        "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
    result = run_command([sys.executable, "scripts/sft.py", "recipes/examples/tiny_llama_tools.yaml",
                          "--model_name_or_path", str(model), "--audit-data", "1"], timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: This source has tool-calling rows. The chat template renders no tool definitions or no assistant "
        "tool_calls")
