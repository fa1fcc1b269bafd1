#!/usr/bin/env python
"""Write the project's small image SFT sample (dataset_format: vision_messages), drawn with PIL.

    .venv/bin/python scripts/make_vision_sample_data.py [--out-dir data/samples/vision]

Each row asks about one or two generated images -- a shape's colour, its kind, how many shapes there
are, or the word written in the image -- and answers what is visible in it, so the answer can only be
learned from the pixels. Images are small PNGs (64-128 px a side: 4-16 image tokens on the tiny twin),
paths relative to the data file, in TRL's shape: `messages` with `{"type": "image"}` / `{"type":
"text"}` parts and an `images` column. A fixed seed makes the files byte-for-byte reproducible (on one
Pillow version: its font rendering decides the text images' pixels).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

SEED = 4321
ROWS = 60
DEFAULT_OUT_DIR = Path(__file__).resolve().parents[1] / "data" / "samples" / "vision"
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "yellow": (235, 200, 20),
           "purple": (140, 50, 170), "orange": (245, 140, 20)}
SHAPES = ("circle", "square", "triangle")
WORDS = ("cat", "sun", "tree", "boat", "milk", "star", "door", "fish")
NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], colour) -> None:
    left, top, right, bottom = box
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([((left + right) // 2, top), (right, bottom), (left, bottom)], fill=colour)


def shape_image(rng: random.Random, shape: str, colour: str, count: int = 1) -> Image.Image:
    width, height = rng.choice((64, 96, 128)), rng.choice((64, 96))
    image = Image.new("RGB", (width, height), (250, 250, 250))
    draw = ImageDraw.Draw(image)
    size = min(width // count, height) - 12
    for index in range(count):
        left = index * (width // count) + 6
        draw_shape(draw, shape, (left, 6, left + size, 6 + size), COLOURS[colour])
    return image


def word_image(word: str) -> Image.Image:
    image = Image.new("RGB", (96, 64), (255, 255, 255))
    ImageDraw.Draw(image).text((12, 16), word.upper(), fill=(0, 0, 0), font=ImageFont.load_default(size=28))
    return image


def user(*parts: str) -> dict:
    return {"role": "user", "content": [{"type": "image"} if part == "<image>" else {"type": "text", "text": part}
                                        for part in parts]}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def make_row(rng: random.Random, kind: str) -> tuple[list[dict], list[Image.Image]]:
    shape, colour = rng.choice(SHAPES), rng.choice(sorted(COLOURS))
    if kind == "colour":
        return [user("<image>", "What colour is the shape?"), assistant(f"It is {colour}.")], \
            [shape_image(rng, shape, colour)]
    if kind == "shape":
        return [user("<image>", "What shape is in the picture?"), assistant(f"A {colour} {shape}.")], \
            [shape_image(rng, shape, colour)]
    if kind == "count":
        count = rng.randint(1, 3)
        noun = shape if count == 1 else shape + "s"
        return [user("<image>", f"How many {shape}s are there?"), assistant(f"There {'is' if count == 1 else 'are'} "
                                                                            f"{NUMBER_WORDS[count]} {noun}.")], \
            [shape_image(rng, shape, colour, count)]
    if kind == "word":
        word = rng.choice(WORDS)
        return [user("<image>", "What word is written in the image?"), assistant(f"The word is {word.upper()}.")], \
            [word_image(word)]
    other = rng.choice([c for c in sorted(COLOURS) if c != colour])  # two images: compare their colours
    return [user("<image>", "<image>", "Are the two shapes the same colour?"),
            assistant(f"No: the first is {colour}, the second is {other}.")], \
        [shape_image(rng, shape, colour), shape_image(rng, shape, other)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    out_dir = parser.parse_args().out_dir
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    kinds = ("colour", "shape", "count", "word", "compare")
    lines = []
    for index in range(ROWS):
        messages, images = make_row(rng, kinds[index % len(kinds)])
        names = []
        for number, image in enumerate(images):
            name = f"images/{index:03d}_{number}.png"
            image.save(out_dir / name, optimize=True)
            names.append(name)
        lines.append(json.dumps({"messages": messages, "images": names}, ensure_ascii=False))
    (out_dir / "shapes.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {ROWS} rows and their images to {out_dir}")


if __name__ == "__main__":
    main()
