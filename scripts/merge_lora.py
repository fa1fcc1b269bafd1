#!/usr/bin/env python3
"""Merge a LoRA adapter (attention and MoE experts) into its base: a plain checkpoint for transformers.

    .venv/bin/python scripts/merge_lora.py ADAPTER_DIR OUT_DIR [--base PATH_OR_HUB_ID] [--dtype bfloat16]

The base is the adapter's `base_model_name_or_path` unless --base says otherwise; an MXFP4 base
(gpt-oss) is dequantized. The merge runs one safetensors shard at a time (never the whole model
twice in memory), into OUT_DIR.incomplete; only after the merged model's logits match base +
adapter on probe inputs is it renamed to OUT_DIR. Exit status 1 when they do not.
The check computes in fp32, one model at a time: ~470 GB for gpt-oss-120b, so on a GPU node pass
--device-map auto.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from functools import partial
from pathlib import Path

from sft_recipes.command_line import OneLineParser
from sft_recipes.errors import RecipeError, one_line_refusals
from sft_recipes.loading import DTYPES, cache_only
from sft_recipes.merge import merge_checkpoint, verify_merge
from sft_recipes.reporting.load_export import ADAPTER_CONFIG, output_dir_refusal
from sft_recipes.script_exit import run_then_exit


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(prog="scripts/merge_lora.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("adapter_dir", type=Path, help="PEFT adapter (adapter_config.json + adapter_model.safetensors)")
    parser.add_argument("out_dir", type=Path, help="where the merged checkpoint goes (must not exist)")
    parser.add_argument("--base", help="base checkpoint dir or Hub id (default: the adapter's base_model_name_or_path)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="dtype of the merged weights")
    parser.add_argument("--device-map", default=None, help="where the logit check runs, e.g. auto (default: CPU)")
    return parser.parse_args(argv)


def resolve_base(adapter_dir: Path, base: str | None) -> Path:
    """A local directory holding the base checkpoint (downloaded from the Hub if it is a repo id)."""
    if not (adapter_dir / ADAPTER_CONFIG).is_file():
        raise RecipeError(output_dir_refusal(adapter_dir, f"holds no LoRA adapter (no {ADAPTER_CONFIG}; a full "
                                             "fine-tune's export needs no merge)"))
    adapter_config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    name = base or adapter_config.get("base_model_name_or_path")
    if not name:
        raise RecipeError(f"{adapter_dir}/{ADAPTER_CONFIG} names no base model: pass --base PATH_OR_HUB_ID.")
    if Path(name).is_dir():
        return Path(name)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    revision = None if base else adapter_config.get("revision")
    offline = cache_only(name)  # the Hub cannot be asked: the cache only, without ~30 s of retries
    try:
        # Top-level files only: openai/gpt-oss-* also ship original/ and metal/ copies of the weights.
        return Path(snapshot_download(name, revision=revision, allow_patterns=["*.json", "*.safetensors", "*.jinja"],
                                      ignore_patterns=["*/*"], local_files_only=bool(offline)))
    except LocalEntryNotFoundError:
        if not offline:
            raise
        raise RecipeError(f"The base {name} is not a folder here nor in the Hugging Face cache, and the Hub cannot be "
                          f"asked for it ({offline}): pass --base with the base checkpoint's folder, or run where the "
                          "Hub answers.") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_command_line(sys.argv[1:] if argv is None else argv)
    if args.out_dir.exists():
        raise RecipeError(f"{args.out_dir} exists: choose a new OUT_DIR.")
    dtype = DTYPES[args.dtype]
    base_dir = resolve_base(args.adapter_dir, args.base)
    staging = args.out_dir.with_name(args.out_dir.name + ".incomplete")
    shutil.rmtree(staging, ignore_errors=True)

    try:
        report = merge_checkpoint(base_dir, args.adapter_dir, staging, dtype)
    except ValueError as err:  # the adapter does not fit this base: its message names the fix (--base)
        shutil.rmtree(staging, ignore_errors=True)
        raise RecipeError(str(err)) from None
    print(f"[merge] {report.merged} LoRA targets ({report.expert_stacks} expert stacks) merged into "
          f"{report.shards} shard(s) of {base_dir}", flush=True)
    check = verify_merge(base_dir, args.adapter_dir, staging, dtype, args.device_map)
    summary = check.summary()
    if not check.passed:
        print(f"error: the merged model in {staging} does not reproduce base + adapter: {summary}. "
              "Do not use it.", file=sys.stderr)
        return 1
    staging.rename(args.out_dir)
    print(f"[merge] verified: {summary}\n[merge] {args.out_dir}: loads with "
          f"AutoModelForCausalLM.from_pretrained({str(args.out_dir)!r})", flush=True)
    return 0


if __name__ == "__main__":
    run_then_exit(partial(one_line_refusals, main))  # a clean end skips the interpreter's teardown (script_exit)
