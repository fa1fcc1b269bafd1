#!/usr/bin/env python3
"""Chat with a run's export: a consolidated model, or base + PEFT adapter (read from OUTPUT_DIR).

    .venv/bin/python scripts/chat.py outputs/demo                                # interactive; empty line or Ctrl-D ends
    .venv/bin/python scripts/chat.py outputs/demo --prompt "What is 2 + 3?"      # answer once, exit 0
    .venv/bin/python scripts/chat.py outputs/lora --base_model path/to/base      # adapter onto another copy of its base
    .venv/bin/python scripts/chat.py outputs/vision --image cat.png --prompt "What is in the picture?"  # a VLM export
    .venv/bin/python scripts/chat.py outputs/tools --tools tools.json --prompt "Area of a 10 x 5 triangle?"
    .venv/bin/python scripts/chat.py outputs/demo --system "Answer in one word." --prompt "Capital of France?"

--tools FILE: a JSON list of function schemas ({type: function, function: {name, description, parameters}} or
the bare {name, description, parameters}), given to the chat template as `tools=`, as a tool row's `tools`
are in training; the model's calls are printed, not run.

Each turn goes through the tokenizer's chat template (the whole conversation so far); the answer
streams token by token. Greedy unless --temperature > 0. --base_model is for an adapter export only (a full
export is refused with it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from sft_recipes.command_line import OneLineParser, non_negative_float, positive_int
from sft_recipes.data.masking import check_renders_tools
from sft_recipes.data.tools import ToolDataError, parsed_tools
from sft_recipes.reporting.load_export import export_kind, load_export
from sft_recipes.reporting.replies import ReplyStreamer, one_kernel_fallback_line, shown_reply
from sft_recipes.script_exit import run_then_exit


def answer(model, tokenizer, conversation: list[dict], max_new_tokens: int, temperature: float,
           inputs: dict | None = None, tools: list[dict] | None = None) -> str:
    if inputs is None:
        inputs = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True, **({"tools": tools} if tools else {}))
    streamer = ReplyStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)  # no empty <think></think>
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, streamer=streamer,
                                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, **sampling)
    return shown_reply(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)).strip()


def read_tools(path: str) -> list[dict]:
    """The schemas of a --tools file, as training reads a row's `tools` (`sft_recipes.data.tools`)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"cannot read --tools {path}: {err.strerror}") from None
    try:
        tools = parsed_tools(text)
    except ToolDataError as err:
        raise ValueError(f"--tools {path}: {err}; give a JSON list of function schemas "
                         "([{\"name\": ..., \"description\": ..., \"parameters\": {...}}])") from None
    if not tools:
        raise ValueError(f"--tools {path} holds no tool; give a JSON list of function schemas")
    return tools


def opening(system: str | None) -> list[dict]:
    """A conversation's first messages: the --system prompt, as a row's system message is in training."""
    return [{"role": "system", "content": system}] if system else []


def image_prompt_inputs(output_dir: str, model, tokenizer, prompt: str, image_paths: list[str],
                        system: str | None = None) -> dict:
    """The question with its images placed before it, as vision_messages rows are trained."""
    from transformers import AutoImageProcessor

    from sft_recipes.data.vision import IMAGE_PLACEHOLDER, VisionProcessing, image_record, open_image

    if not hasattr(model.config, "vision_config"):
        raise ValueError(f"{output_dir} is a text-only model; --image needs a VLM export.")
    images = [open_image(image_record(path, None)) for path in image_paths]
    problems = [f"{path}: {image}" for path, image in zip(image_paths, images) if isinstance(image, str)]
    if problems:
        raise ValueError(f"cannot read {', '.join(problems)}; give PNG/JPEG files.")
    processing = VisionProcessing(tokenizer, AutoImageProcessor.from_pretrained(output_dir, backend="pil"),
                                  model.config)
    conversation = [*opening(system), {"role": "user", "content": IMAGE_PLACEHOLDER * len(images) + prompt}]
    return processing.prompt_inputs(conversation, images)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="scripts/chat.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir")
    parser.add_argument("--prompt", help="answer this one message and exit")
    parser.add_argument("--max_new_tokens", type=positive_int("the most tokens one answer may have (default 256)"),
                        default=256, help="the most tokens one answer may have (default 256)")
    parser.add_argument("--temperature", type=non_negative_float("0 for greedy answers (the default), or e.g. 0.7 "
                                                                 "to sample"),
                        default=0.0, help="0 (the default): greedy; above 0: sample at this temperature")
    parser.add_argument("--base_model", help="for an adapter: load it onto this base instead of the one it names")
    parser.add_argument("--image", action="append", default=[],
                        help="with --prompt: an image the question is about (a VLM export; repeat for several)")
    parser.add_argument("--system", help="a system prompt to open every conversation with (as your rows' system turn)")
    parser.add_argument("--tools", help="a JSON file with the function schemas the model may call (chat template tools=)")
    args = parser.parse_args(argv)
    one_kernel_fallback_line()
    try:
        tools = read_tools(args.tools) if args.tools else None
        if export_kind(args.output_dir, "make chat OUT={}") == "full" and args.base_model is not None:
            raise ValueError(f"--base_model puts an adapter onto a base, and {args.output_dir} holds a whole model "
                             "(config.json, no adapter_config.json), which loads as it is: drop --base_model")
        model, tokenizer = load_export(args.output_dir, args.base_model)
        if tools:
            check_renders_tools(tokenizer)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.image:
        if args.prompt is None:
            print("error: --image answers one question about it: give --prompt too", file=sys.stderr)
            return 2
        try:
            inputs = image_prompt_inputs(args.output_dir, model, tokenizer, args.prompt, args.image, args.system)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        answer(model, tokenizer, [], args.max_new_tokens, args.temperature, inputs=inputs)
        return 0
    if args.prompt is not None:
        answer(model, tokenizer, [*opening(args.system), {"role": "user", "content": args.prompt}],
               args.max_new_tokens, args.temperature, tools=tools)
        return 0
    conversation = opening(args.system)
    while True:
        try:
            message = input("\nyou> ").strip()
        except EOFError:
            break
        if not message:
            break
        conversation.append({"role": "user", "content": message})
        print("model> ", end="", flush=True)
        conversation.append({"role": "assistant", "content": answer(model, tokenizer, conversation,
                                                                    args.max_new_tokens, args.temperature,
                                                                    tools=tools)})
    return 0


if __name__ == "__main__":
    run_then_exit(main)  # a clean end skips the interpreter's teardown of the loaded stack (script_exit)
