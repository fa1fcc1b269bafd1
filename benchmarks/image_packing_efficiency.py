#!/usr/bin/env python3
"""Image + text packing efficiency: real tokens / token slots (and the padding share), one example per row vs packed.

    .venv/bin/python benchmarks/image_packing_efficiency.py           # ~1 minute
    .venv/bin/python benchmarks/image_packing_efficiency.py --quick   # seconds: a smoke run

The examples are LLaVA-Instruct-like image conversations: 1-4 turns of 20-120 words each, 1 image (15%:
2-3 images) of 224-1344 pixels a side, every image's tokens counted exactly as Qwen3.5 counts them (its
image processor's `smart_resize` at the recipe's min/max_pixels, 16-pixel patches merged 2x2: the tiny
twin's processor has the real checkpoint's geometry), the text tokenized by the tiny twin's chat template
and tokenizer (a 512-token vocabulary: more tokens per word than the real one). 15% of the conversations
are text only (a mixture with a chat source). Strategies, on the same examples:

* one example per row, padded to the block (`max_length`): what TRL trains on image data, whose padding-free
  and packing are refused for VLMs;
* one example per row, padded to the longest of a batch of 8 (dynamic padding);
* ours: whole examples packed into `max_length` blocks (`fill_blocks(split_examples=False)`, the image block
  stream's packer), arrival order (`packing_window` 1) and best-fit over 1024 waiting examples (the default).

Examples longer than a block are dropped (counted), as the image block stream drops them.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment_header, markdown_table  # noqa: E402

WORDS = ("the", "image", "shows", "a", "red", "car", "parked", "near", "tall", "building", "with", "two", "people",
         "walking", "on", "street", "what", "colour", "is", "sign", "describe", "scene", "detail", "left", "right")


def conversations(rng: random.Random, count: int):
    """(flat conversation, image sizes) pairs."""
    for _ in range(count):
        images = [] if rng.random() < 0.15 else [None] * (1 if rng.random() < 0.85 else rng.randint(2, 3))
        sizes = [(rng.randint(224, 1344), rng.randint(224, 1344)) for _ in images]
        turns = rng.randint(1, 4)
        messages = []
        for turn in range(turns):
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))
            placeholder = "<|vision_start|><|image_pad|><|vision_end|>" * len(images) if turn == 0 else ""
            messages += [{"role": "user", "content": placeholder + question},
                         {"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120)))}]
        yield messages, sizes


def report(options: argparse.Namespace, argv: list[str]) -> str:
    from sft_recipes.data.blocks import fill_blocks
    from sft_recipes.data.masking import tokenize_conversations
    from sft_recipes.tiny import build_tokenizer, tiny_config, tiny_image_processor

    tokenizer = build_tokenizer("qwen3_5")
    processor = tiny_image_processor(tiny_config("qwen3_5"))
    bounds = {"min_pixels": options.min_pixels, "max_pixels": options.max_pixels}
    rng = random.Random(0)
    pairs = list(conversations(rng, options.examples))
    masked = tokenize_conversations(tokenizer, [messages for messages, _ in pairs])
    lengths, image_tokens = [], 0
    for ids, (_, sizes) in zip(masked["input_ids"], pairs):
        tokens = [processor.get_number_of_image_patches(h, w, bounds) // 4 for w, h in sizes]
        image_tokens += sum(tokens)
        lengths.append(len(ids) + sum(tokens) - len(tokens))
    block = options.max_length
    kept = [n for n in lengths if n <= block]
    dropped = len(lengths) - len(kept)
    real = sum(kept)
    rows = []

    def row(name: str, count: int, slots: int, note: str = "") -> None:
        rows.append([name, f"{count:,}", f"{slots:,}", f"{real:,}", f"{real / slots:.2%}", f"{1 - real / slots:.2%}",
                     note])

    row("one example per row, padded to max_length", len(kept), len(kept) * block, "TRL on image data")
    batches = [kept[i:i + 8] for i in range(0, len(kept), 8)]
    row("one example per row, padded to the batch's longest (8)", len(kept), sum(len(b) * max(b) for b in batches),
        "dynamic padding")
    for window, name in ((1, "ours, whole examples, arrival order"), (1024, "ours, whole examples, best-fit 1024")):
        examples = ({"input_ids": [0] * n, "labels": [0] * n} for n in kept)
        blocks = list(fill_blocks(examples, block, split_examples=False, window=window))
        assert sum(len(b["input_ids"]) for b in blocks) == real
        row(name, len(blocks), len(blocks) * block, f"packing_window {window}")
    total_tokens = sum(lengths)
    lines = [
        environment_header("Image + text packing efficiency", argv), "",
        f"- {len(lengths):,} conversations ({sum(1 for _, s in pairs if s):,} with images, "
        f"{sum(len(s) for _, s in pairs):,} images), {total_tokens:,} tokens of which {image_tokens:,} image tokens "
        f"({image_tokens / total_tokens:.1%}); min_pixels {options.min_pixels:,}, max_pixels {options.max_pixels:,}; "
        f"block {block:,} tokens; {dropped:,} conversations longer than a block dropped "
        f"(mean length {total_tokens / len(lengths):,.0f}, longest {max(lengths):,})",
        "",
        markdown_table(["strategy", "rows", "token slots", "real tokens", "real / slots", "padding share", "note"],
                       rows),
    ]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few examples")
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--max_length", type=int, default=8192)
    parser.add_argument("--min_pixels", type=int, default=3136)
    parser.add_argument("--max_pixels", type=int, default=602112)
    options = parser.parse_args(argv)
    if options.quick:
        options.examples = 60
    return options


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print(report(parse_args(argv), [sys.argv[0], *argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
