#!/usr/bin/env python
"""Write a tiny, randomly initialised checkpoint of a recipe's architecture (offline).

    .venv/bin/python scripts/make_tiny.py {llama,qwen3_5,gpt_oss} OUT_DIR [--seed 0]
"""

from __future__ import annotations

import argparse

from sft_recipes.tiny import AUTO_MODEL_CLASSES, MODEL_TYPES, build_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_type", choices=MODEL_TYPES)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed (same seed, same weights)")
    args = parser.parse_args()
    out_dir = build_tiny_model(args.model_type, args.out_dir, seed=args.seed)
    print(f"wrote tiny {args.model_type} to {out_dir}; load it with {AUTO_MODEL_CLASSES[args.model_type].__name__}")


if __name__ == "__main__":
    main()
