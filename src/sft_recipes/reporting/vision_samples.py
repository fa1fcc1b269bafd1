"""Sample prompts about images (image runs): where they come from, how the VLM answers them, how they are shown.

- A recipe's `sample_prompts` entry ``{text: "...", images: [path, ...]}``: the images (paths relative to the
  working directory, like `dataset_name`) come before the text in the user turn, as `scripts/chat.py --image`
  puts them and as the sample data has them. They are read when the run starts: a missing or unreadable file
  is a RecipeError that names it.
- The defaults of an image run: each image row's first user turn with its own images (the first ones of the
  row's `images`, one per image in that turn), from the rows as the run trains them (flat conversations, image
  records resolved against the data file's folder, unreadable rows already dropped).
- Rendered as training renders a row: the flat turn (`flatten_parts`' form, one IMAGE_PLACEHOLDER per image)
  through the chat template, each placeholder expanded to its image's tokens by the run's `VisionProcessing`
  (its min/max_pixels), with the pixel_values, image_grid_thw and mm_token_type_ids the model takes.
- Positions: the prefill gets the layout the packed path trains on, ``[4, 1, L]``: row 0 the text positions
  0..L-1, rows 1-3 the model's own t/h/w positions (`mrope_positions`); each new token then takes the previous
  maximum + 1 on every row (`samples.greedy_generate`), which is what transformers' `generate` derives from its
  rope_deltas. Plain 1-D positions would place the text after an image where the model never saw it in training.
- One prompt per batch: no left padding of mRoPE rows.
- Names (samples.md, samples_before.json): an image's path as the recipe or the run's rows give it, or
  ``bytes:<sha1 prefix>`` for an image stored as bytes (a `datasets` Image column), so that a resumed run's
  prompts match the saved ones only when they are the same images.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from sft_recipes.errors import RecipeError

RECIPE_KEYS = ("text", "images")


@dataclass(frozen=True)
class ImagePrompt:
    """A user turn about images: its flat text and its images, and once `prepared`, what the model takes."""

    turn: str  # the user turn, IMAGE_PLACEHOLDER where each image stands
    records: tuple[dict[str, Any], ...] = field(compare=False)  # `image_record`s, in order
    names: tuple[str, ...]
    sizes: tuple[tuple[int, int], ...]  # (width, height) as given, before the image processor resizes
    prefill: dict[str, torch.Tensor] | None = field(default=None, compare=False, repr=False)

    def as_json(self) -> dict[str, Any]:
        return {"text": self.turn, "images": list(self.names)}

    def shown(self) -> str:
        """The turn with each image as ``[image N: name, WxH]`` on its own line (samples.md)."""
        from sft_recipes.data.vision import IMAGE_PLACEHOLDER

        pieces = self.turn.split(IMAGE_PLACEHOLDER)
        lines = [pieces[0]] if pieces[0] else []
        for index, (name, (width, height), text) in enumerate(zip(self.names, self.sizes, pieces[1:])):
            lines.append(f"[image {index + 1}: {name}, {width}x{height}]")
            if text:
                lines.append(text)
        return "\n".join(lines)


def image_name(record: dict[str, Any]) -> str:
    if record.get("bytes"):
        return "bytes:" + hashlib.sha1(record["bytes"]).hexdigest()[:12]
    return record["path"]


def image_prompt(turn: str, records: list[dict[str, Any]]) -> ImagePrompt | str:
    """The prompt of `turn` about the images of `records`, or the drop reason of the first that cannot be read."""
    from sft_recipes.data.vision import open_image

    sizes = []
    for record in records:
        image = open_image(record)
        if isinstance(image, str):
            return image
        sizes.append(image.size)
    return ImagePrompt(turn, tuple(records), tuple(image_name(r) for r in records), tuple(sizes))


def recipe_image_prompt(entry: Any, index: int) -> ImagePrompt:
    """A recipe's ``{text: ..., images: [path, ...]}`` sample prompt, its images read now (RecipeError if not)."""
    from sft_recipes.data.vision import IMAGE_PLACEHOLDER, VISION_TOKENS, image_record

    where = f"sample_prompts[{index}]"
    if (not isinstance(entry, dict) or set(entry) - set(RECIPE_KEYS) or not isinstance(entry.get("text"), str)
            or not isinstance(entry.get("images"), list) or not entry["images"]
            or not all(isinstance(path, str) and path for path in entry["images"])):
        raise RecipeError(f"{where} is {entry!r}: a sample prompt is a string, or a mapping {{text: \"...\", images: "
                          "[path, ...]}} (one or more image paths, relative to the working directory).")
    if any(token in entry["text"] for token in VISION_TOKENS):
        raise RecipeError(f"{where}: its text holds vision tokens ({', '.join(VISION_TOKENS)}); write the question "
                          "alone: its images are placed before it.")
    records = [image_record(path, None) for path in entry["images"]]
    prompt = image_prompt(IMAGE_PLACEHOLDER * len(records) + entry["text"], records)
    if isinstance(prompt, str):
        from sft_recipes.data.vision import open_image

        bad = next(path for path, record in zip(entry["images"], records) if isinstance(open_image(record), str))
        raise RecipeError(f"{where}: cannot read image {bad} ({prompt}): give the path of a PNG or JPEG file, "
                          "relative to the directory the run starts in, or remove the prompt.")
    return prompt


def row_image_prompt(row: dict[str, Any]) -> ImagePrompt | str | None:
    """The first user turn of a checked image row (flat messages + image records) with its own images; a turn
    without images is a text prompt; None when the row has no user turn (or its images cannot be read)."""
    from sft_recipes.data.vision import IMAGE_PLACEHOLDER

    records, before = list(row.get("images") or []), 0
    for message in row.get("messages") or []:
        content = message.get("content")
        if message.get("role") != "user" or not content:
            before += content.count(IMAGE_PLACEHOLDER) if isinstance(content, str) else 0
            continue
        count = content.count(IMAGE_PLACEHOLDER)
        if not count:
            return content
        prompt = image_prompt(content, records[before:before + count])
        return None if isinstance(prompt, str) else prompt
    return None


def prepared(prompt: ImagePrompt, processing, template_kwargs: dict[str, Any] | None = None) -> ImagePrompt:
    """`prompt` with its prefill inputs, rendered by the run's `VisionProcessing` as its training rows are."""
    from sft_recipes.data.vision import open_image, packed_position_ids

    images = [open_image(record) for record in prompt.records]
    example = processing.prompt_example([{"role": "user", "content": prompt.turn}], images,
                                        **(template_kwargs or {}))
    input_ids = torch.tensor([example.input_ids])
    text_positions = torch.arange(input_ids.shape[1])[None]
    return replace(prompt, prefill={
        "input_ids": input_ids, "pixel_values": example.pixel_values, "image_grid_thw": example.image_grid_thw,
        "mm_token_type_ids": (input_ids == processing.image_token_id).int(),
        "position_ids": packed_position_ids(text_positions, [example.mrope_positions]),  # [4, 1, L]
    })


def prompt_json(prompt: str | ImagePrompt) -> str | dict[str, Any]:
    """How samples_before.json keeps a prompt (a text prompt: its string, as before image prompts existed)."""
    return prompt.as_json() if isinstance(prompt, ImagePrompt) else prompt


def shown_prompt(prompt: str | ImagePrompt) -> str:
    return prompt.shown() if isinstance(prompt, ImagePrompt) else prompt


def prepared_prompts(prompts: list[str | ImagePrompt], processing, template_kwargs: dict[str, Any] | None = None
                     ) -> list[str | ImagePrompt]:
    """The run's sample prompts, each image prompt `prepared` by the run's `VisionProcessing` (None: a text run,
    which cannot answer about images)."""
    if processing is None and any(isinstance(prompt, ImagePrompt) for prompt in prompts):
        raise RecipeError("sample_prompts has a prompt with images, and this run trains on no images (no "
                          "dataset_format: vision_messages source): give text prompts, or train on image data.")
    return [prepared(prompt, processing, template_kwargs) if isinstance(prompt, ImagePrompt) else prompt
            for prompt in prompts]
