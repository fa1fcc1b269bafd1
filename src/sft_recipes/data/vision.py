"""Image + text conversations (`dataset_format: vision_messages`) -> tokens, labels, pixels and mRoPE positions.

The rows are TRL's vision shape: `messages` whose `content` is a list of parts (`{"type": "image"}`,
`{"type": "text", "text": ...}`) and an `images` column (paths relative to the data file, `datasets`
`Image` features, or raw bytes), one image per image part, in order.

How a conversation becomes what the model trains on:

1. Its parts are flattened to one string per message, each image part written as
   ``<|vision_start|><|image_pad|><|vision_end|>`` -- exactly what Qwen3.5's (and Qwen3-VL's) own chat
   template writes for it -- so the conversation is an ordinary chat, masked assistant-only by
   `masking.py` like every other (the prompt, and so every image token, never in the loss). The flat
   form also lets image and text-only sources share one Arrow type in a mixture.
2. Each image goes through the model's image processor (`min_pixels`/`max_pixels` bound its size and so
   its tokens); its one ``<|image_pad|>`` token is expanded to ``grid_t * grid_h * grid_w / merge_size**2``
   copies, never supervised. This is the expansion `Qwen3VLProcessor` performs on text (tested against
   it token for token); done on tokens it keeps the masks aligned.
3. Its multimodal positions are the model's own: transformers' ``Qwen3_5Model.get_rope_index``, run on
   this conversation alone (three rows t/h/w), beside the plain text position 0..L-1 that transformers
   keeps as row 0 for its masks. Packed, each example keeps exactly the positions it has alone.

transformers 5.23's `Qwen3VLProcessor` cannot be built without torchvision (its video processor
needs it; the PyPI torchvision wheel does not load against the CPU torch build), so the run composes
the tokenizer and the PIL image processor (`Qwen2VLImageProcessorPil`) itself: no new dependency.

Row rules (drop reasons, counted in the data report; a source with nothing left is an error):
`image_count_mismatch` (image parts != images), `misplaced_image` (an image in an assistant turn,
which would be a target, or literal vision tokens typed in a text part), `missing_image`,
`unreadable_image` (a corrupt file or bytes), `image_size` (zero-size, over `MAX_IMAGE_PIXELS`, or an
aspect ratio over `MAX_ASPECT_RATIO`, which the image processor refuses).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

from sft_recipes.data.blocks import IGNORE_INDEX, SOURCE_FIELD, RankLocalBlockStream, StreamStats
from sft_recipes.data.collator import BlockDiagonalCollator
from sft_recipes.data.masking import KEPT, tokenize_conversations
from sft_recipes.data.rows import (
    IMAGE_COUNT_MISMATCH,
    IMAGE_SIZE,
    MISPLACED_IMAGE,
    MISSING_IMAGE,
    OVERLONG,
    ROW_PROBLEM,
    UNREADABLE_IMAGE,
    messages_problem,
)

VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END  # what Qwen3.5's template writes for an image part
VISION_TOKENS = (VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD)
MAX_IMAGE_PIXELS = 178_956_970  # PIL's decompression-bomb limit: anything larger is not a photo
MAX_ASPECT_RATIO = 200  # Qwen2-VL's smart_resize refuses longer sides
IMAGES_FIELD = "images"


# ── Rows ─────────────────────────────────────────────────────────────────────────────────────────

def flatten_parts(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int] | str:
    """(messages with string contents, number of image parts), or the drop reason of the row.

    A string content stays as it is (an already flat row: idempotent); a list of parts becomes its texts with
    IMAGE_PLACEHOLDER for each image.
    """
    flat, images = [], 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            pieces = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image":
                    if message.get("role") == "assistant":
                        return MISPLACED_IMAGE
                    pieces.append(IMAGE_PLACEHOLDER)
                    images += 1
                elif kind == "text" and isinstance(part.get("text"), str):
                    if any(token in part["text"] for token in VISION_TOKENS):
                        return MISPLACED_IMAGE
                    pieces.append(part["text"])
                else:
                    return MISPLACED_IMAGE if kind in ("video", "image_url") else "not_a_string"
            content = "".join(pieces)
        flat.append({**message, "content": content} if isinstance(message, dict) else message)
    return flat, images


def vision_row_problem(row: dict[str, Any]) -> str | None:
    """The structural row rules of a row as the data has it (the images themselves are checked where their files
    are known: `check_images`). Vision tokens typed into a string content would pose as images."""
    messages = row.get("messages")
    if isinstance(messages, list) and any(isinstance(m, dict) and isinstance(m.get("content"), str)
                                          and any(token in m["content"] for token in VISION_TOKENS) for m in messages):
        return MISPLACED_IMAGE
    flat = flatten_parts(messages) if isinstance(messages, list) else None
    if isinstance(flat, str):
        return flat
    problem = messages_problem(flat[0] if flat else row.get("messages"))
    if problem:
        return problem
    images = row.get(IMAGES_FIELD) or []
    if not isinstance(images, list) or len(images) != flat[1]:
        return IMAGE_COUNT_MISMATCH
    return None


def image_record(value: Any, base_dir: Path | None) -> dict[str, Any]:
    """One image as ``{"bytes": bytes | None, "path": str | None}`` (the `datasets` Image storage), a relative path
    resolved against the data file's folder."""
    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return {"bytes": buffer.getvalue(), "path": None}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value), "path": None}
    if isinstance(value, dict):
        if value.get("bytes"):
            return {"bytes": value["bytes"], "path": None}
        value = value.get("path")
    if not isinstance(value, str) or not value:
        return {"bytes": None, "path": None}
    path = Path(value)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    return {"bytes": None, "path": str(path)}


def open_image(record: dict[str, Any], decode: bool = True) -> Image.Image | str | None:
    """The image of an `image_record` decoded as RGB (or, with ``decode=False``, None once its file is checked:
    header, size and -- for PNG -- every chunk's checksum, without decoding pixels), or its drop reason.

    The up-front check (`check_images`) does not decode; an image that still fails to decode when a reader
    tokenizes its row is dropped and counted there, under the same reason."""
    if record.get("bytes"):
        source = io.BytesIO(record["bytes"])
    elif record.get("path") and Path(record["path"]).is_file():
        source = record["path"]
    else:
        return MISSING_IMAGE
    try:
        with Image.open(source) as image:
            width, height = image.size
            if (width < 1 or height < 1 or width * height > MAX_IMAGE_PIXELS
                    or max(width, height) > MAX_ASPECT_RATIO * min(width, height)):
                return IMAGE_SIZE
            if not decode:
                image.verify()  # reads the file through (PNG: chunk CRCs) without decoding it
                return None
            return image.convert("RGB")  # decodes every pixel: a truncated file fails here
    except Image.DecompressionBombError:  # PIL refuses to open more than MAX_IMAGE_PIXELS: a size, not a corrupt file
        return IMAGE_SIZE
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        return UNREADABLE_IMAGE


def check_images(rows, base_dir: Path | None, report) -> tuple[list[dict[str, Any]], list[int]]:
    """(the rows as flat conversations with `image_record`s, indices kept): unreadable images dropped into `report`."""
    kept, indices = [], []
    for index, row in enumerate(rows):
        records = [image_record(value, base_dir) for value in row.get(IMAGES_FIELD) or []]
        problem = next((reason for reason in map(_image_problem, records) if reason), None)
        if problem:
            report.drop(problem, f"row {index}", {"messages": row.get("messages"),
                                                  IMAGES_FIELD: [r["path"] or "<bytes>" for r in records]})
            continue
        messages, _ = flatten_parts(row["messages"])
        kept.append({"messages": messages, IMAGES_FIELD: records})
        indices.append(index)
    return kept, indices


def _image_problem(record: dict[str, Any]) -> str | None:
    return open_image(record, decode=False)


# ── Tokens, pixels, positions ────────────────────────────────────────────────────────────────────

@dataclass
class VisionExample:
    input_ids: list[int]
    labels: list[int]
    pixel_values: torch.Tensor  # [patches, channels * temporal_patch * patch * patch]; 0 rows for text only
    image_grid_thw: torch.Tensor  # [images, 3]
    mrope_positions: torch.Tensor  # [3, len(input_ids)]: the model's own t/h/w positions for this example alone


class VisionProcessing:
    """The model's tokenizer + image processor, composed as `Qwen3VLProcessor` composes them (see module docstring)."""

    def __init__(self, tokenizer, image_processor, model_config, min_pixels: int | None = None,
                 max_pixels: int | None = None):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.config = model_config
        self.image_token_id = model_config.image_token_id
        if tokenizer.convert_tokens_to_ids(IMAGE_PAD) != self.image_token_id:
            raise ValueError(f"The tokenizer's {IMAGE_PAD} id differs from the model's image_token_id "
                             f"{self.image_token_id}: load the tokenizer and model of the same checkpoint.")
        self.merge_size = model_config.vision_config.spatial_merge_size
        self.size = dict(image_processor.size)
        if min_pixels is not None:
            self.size["shortest_edge"] = min_pixels
        if max_pixels is not None:
            self.size["longest_edge"] = max_pixels

    def encode_images(self, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values, image_grid_thw) of `images`, each image processed on its own."""
        if not images:
            width = self.config.vision_config.in_channels * self.config.vision_config.temporal_patch_size * \
                self.config.vision_config.patch_size ** 2
            return torch.zeros(0, width), torch.zeros(0, 3, dtype=torch.long)
        out = self.image_processor(images=images, size=self.size, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"].long()

    def image_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        return (grid_thw.prod(-1) // self.merge_size ** 2).tolist()

    def examples(self, conversations: list[list[dict[str, Any]]], images: list[list[Any]],
                 **template_kwargs: Any) -> list[VisionExample | str]:
        """One `VisionExample` (or drop reason) per flat conversation and its `image_record`s or PIL images."""
        masked = tokenize_conversations(self.tokenizer, conversations, None, **template_kwargs)
        results = []
        for ids, mask, reason, records in zip(masked["input_ids"], masked["assistant_masks"], masked["drop_reason"],
                                              images):
            if reason != KEPT:
                results.append(reason)
                continue
            opened = [record if isinstance(record, Image.Image) else open_image(record) for record in records]
            problem = next((image for image in opened if isinstance(image, str)), None)
            if problem or ids.count(self.image_token_id) != len(opened):
                results.append(problem or IMAGE_COUNT_MISMATCH)
                continue
            pixel_values, grid = self.encode_images(opened)
            results.append(self.expanded(ids, mask, pixel_values, grid))
        return results

    def expanded(self, ids: list[int], mask: list[int], pixel_values: torch.Tensor, grid: torch.Tensor
                 ) -> VisionExample:
        """Each image's one placeholder token repeated to its image-token count (never supervised), and positions."""
        counts = iter(self.image_tokens(grid))
        input_ids, labels = [], []
        for token, keep in zip(ids, mask):
            if token == self.image_token_id:
                repeat = next(counts)
                input_ids += [token] * repeat
                labels += [IGNORE_INDEX] * repeat
            else:
                input_ids.append(token)
                labels.append(token if keep else IGNORE_INDEX)
        positions = mrope_positions(self.config, torch.tensor(input_ids), grid)
        return VisionExample(input_ids, labels, pixel_values, grid, positions)

    def prompt_example(self, conversation: list[dict[str, Any]], images: list[Image.Image],
                       **template_kwargs: Any) -> VisionExample:
        """A flat conversation ending in a user turn about `images`, with the template's generation prompt, as
        `examples` renders a training row: image tokens expanded, the model's own positions (nothing supervised)."""
        ids = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True, **template_kwargs)["input_ids"]
        if ids.count(self.image_token_id) != len(images):
            raise ValueError(f"The prompt has {ids.count(self.image_token_id)} image placeholders for {len(images)} "
                             "images.")
        pixel_values, grid = self.encode_images(images)
        return self.expanded(ids, [0] * len(ids), pixel_values, grid)

    def prompt_inputs(self, conversation: list[dict[str, Any]], images: list[Image.Image]) -> dict[str, torch.Tensor]:
        """`generate` inputs for a flat conversation ending in a user turn about `images` (chat.py --image): the
        template's generation prompt, image tokens expanded; the model computes its positions (mm_token_type_ids)."""
        example = self.prompt_example(conversation, images)
        pixel_values, grid = example.pixel_values, example.image_grid_thw
        input_ids = torch.tensor([example.input_ids])
        inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        if images:
            inputs.update(pixel_values=pixel_values, image_grid_thw=grid,
                          mm_token_type_ids=(input_ids == self.image_token_id).int())
        return inputs


def mrope_positions(config, input_ids: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
    """[3, L] t/h/w positions of one example as the model computes them for it alone (its own `get_rope_index`).

    Only the config is needed (the vision merge size): the method runs on a stand-in holding it, so the data
    readers need no model. A text-only example gets 0..L-1 on all three rows, as in the model.
    """
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    if image_grid_thw.numel() == 0:
        return torch.arange(len(input_ids)).expand(3, -1).clone()
    holder = SimpleNamespace(config=config,
                             get_vision_position_ids=lambda *args, **kwargs: Qwen3_5Model.get_vision_position_ids(
                                 None, *args, **kwargs))
    token_types = (input_ids == config.image_token_id).int()
    positions, _ = Qwen3_5Model.get_rope_index(holder, input_ids[None], token_types[None],
                                              image_grid_thw=image_grid_thw)
    return positions[:, 0]


def packed_position_ids(text_positions: torch.Tensor, mrope: list[torch.Tensor]) -> torch.Tensor:
    """[4, B, T] position_ids of packed rows: row 0 the text positions (0.. per segment: transformers reads the
    packed boundaries from it), rows 1-3 each example's own t/h/w positions (`mrope[b]`: [3, n] for the n real
    tokens of row b, its examples' positions in order); the padding tail counts like text (its row-0 positions)."""
    rows = []
    for text, positions in zip(text_positions, mrope):
        tail = text[positions.shape[1]:].expand(3, -1)
        rows.append(torch.cat([text[None], torch.cat([positions, tail], dim=1)]))
    return torch.stack(rows, dim=1)


def first_example_inputs(block: dict[str, Any], image_token_id: int) -> dict[str, torch.Tensor]:
    """A packed image block's first example as the model takes it alone (the export's reload check): its tokens,
    its own images' patches and grids, and ``mm_token_type_ids`` so that the model computes its positions."""
    ids = torch.tensor([block["input_ids"][: block["seq_lengths"][0]]])
    images = int(block["num_images"][0])
    if not images:
        return {"input_ids": ids}
    grid = block["image_grid_thw"][:images]
    return {"input_ids": ids, "pixel_values": block["pixel_values"][: int(grid.prod(-1).sum())],
            "image_grid_thw": grid, "mm_token_type_ids": (ids == image_token_id).int()}


# ── Packed blocks ────────────────────────────────────────────────────────────────────────────────

class VisionBlockStream(RankLocalBlockStream):
    """`RankLocalBlockStream` over image + text conversations (flat `messages` + `images` records).

    Examples always stay whole (an image's tokens must meet its pixels): blocks are packed best-fit over
    `packing_window`, and a conversation longer than a block is dropped as `overlong` (never cut: a cut
    would separate image tokens from their image, or positions from their tokens). Each example brings its
    pixels, grids and mRoPE positions into its block (`join_examples`).
    """

    def __init__(self, dataset, processing: VisionProcessing, max_length: int, rank: int, world_size: int,
                 **kwargs: Any):
        super().__init__(dataset, processing.tokenizer, max_length, rank, world_size, split_examples=False, **kwargs)
        self.processing = processing

    def _tokenized(self, pending: StreamStats, batches: Iterable[dict[str, list[Any]]]) -> Iterator[dict[str, Any]]:
        for batch in batches:
            rows = len(batch[self.messages_field])
            problems = batch.get(ROW_PROBLEM) or [None] * rows
            sources = batch.get(SOURCE_FIELD) or [0] * rows
            images = batch.get(IMAGES_FIELD) or [[] for _ in range(rows)]
            good = [(conversation, records) for conversation, records, problem
                    in zip(batch[self.messages_field], images, problems) if not problem]
            examples = iter(self.processing.examples([c for c, _ in good], [r or [] for _, r in good],
                                                     **self.template_kwargs) if good else ())
            for problem, source in zip(problems, sources):  # in reading order: each drop travels with its block
                if problem:
                    pending.drop(problem, source)
                    continue
                example = next(examples)
                if isinstance(example, str) or len(example.input_ids) > self.max_length:
                    pending.drop(example if isinstance(example, str) else OVERLONG, source)
                    continue
                pending.keep(example.labels, source)
                yield {"input_ids": example.input_ids, "labels": example.labels,
                       "pixel_values": example.pixel_values, "image_grid_thw": example.image_grid_thw,
                       "mrope_positions": example.mrope_positions,
                       "num_images": torch.tensor([len(example.image_grid_thw)])}

    def exhausted_block(self) -> dict[str, Any]:
        pixel_values, grid = self.processing.encode_images([])
        return {**super().exhausted_block(), "pixel_values": pixel_values, "image_grid_thw": grid,
                "mrope_positions": torch.zeros(3, 0, dtype=torch.long), "num_images": torch.tensor([0])}


@dataclass
class VisionBlockCollator:
    """`BlockDiagonalCollator(block_per_row=True)` for image blocks, plus what the VLM takes for them:

    ``position_ids`` [4, B, T] (`packed_position_ids`: the text row that transformers reads the packed
    boundaries from, then the examples' own t/h/w rows), ``pixel_values`` (every image's patches, block after
    block in example order: the order of their image tokens in the batch) and ``image_grid_thw``. A batch
    without images still carries an empty ``pixel_values``: `qwen3_5.prepare_for_image_packing` then runs the
    tower on a blank image, so that every rank enters it every step (FSDP2 gathers its shards together).
    """

    max_length: int
    pad_token_id: int

    def __call__(self, blocks: list[dict[str, Any]]) -> dict[str, Any]:
        text = BlockDiagonalCollator(self.max_length, self.pad_token_id, block_per_row=True)
        batch = text([{key: block[key] for key in ("input_ids", "labels", "seq_lengths")} for block in blocks])
        rows = []
        for block in blocks:
            positions = block.get("mrope_positions")
            if positions is None:  # a text-only block: t/h/w positions are the text positions
                positions = torch.zeros(3, 0, dtype=torch.long)
            rows.append(positions)
        batch["position_ids"] = packed_position_ids(batch["position_ids"], rows)
        batch["pixel_values"] = torch.cat([block["pixel_values"] for block in blocks])
        batch["image_grid_thw"] = torch.cat([block["image_grid_thw"] for block in blocks])
        return batch
