"""What image data adds to a run's plan (`--dry-run` of a `vision_messages` recipe): the vision tower's parameters
and what trains of them, the image tokens per image, and the memory the tower adds per GPU.

The text plan (`memory`, `report`) counts the blocks' tokens -- image tokens included, they are tokens of the block --
with the tower frozen. On top of it, per GPU:

- trained tower parameters (the merger by default; all with `freeze_vision_tower: false`): bf16-sharded
  weights are in the text plan already; their fp32 gradients and AdamW moments are added here, sharded;
- the tower's activations: with a trained tower, every patch of the block's images keeps about
  ``ACTIVATION_BYTES_PER_HIDDEN`` bytes per hidden unit per block (Megatron's 34 * s * h for bf16, the
  attention being per image: no s^2 term with sdpa/flash chunked by image); frozen, only the merger's input
  (one hidden vector per patch) is kept when the merger trains. A block holds at most
  ``max_length / image_tokens`` images at the image bound.
"""

from __future__ import annotations

import torch
from transformers import AutoModel, PretrainedConfig

from sft_recipes.planner.memory import GIB

ACTIVATION_BYTES_PER_HIDDEN = 34  # per token and hidden unit per transformer block, bf16, attention excluded
# The checkpoint's own bounds when the recipe leaves min/max_pixels unset (Qwen2-VL image processor defaults).
DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS = 3136, 1003520


def vision_plan_lines(recipe, config: PretrainedConfig, world_size: int) -> list[str]:
    vision = config.vision_config
    with torch.device("meta"):
        tower = AutoModel.from_config(vision)
    total = sum(p.numel() for p in tower.parameters())
    merger = sum(p.numel() for p in tower.merger.parameters())
    model_args, data, training = recipe.model, recipe.data, recipe.training
    trainable = total if not model_args.freeze_vision_tower else merger if model_args.train_vision_merger else 0
    pixels_per_token = (vision.patch_size * vision.spatial_merge_size) ** 2
    max_pixels = data.max_pixels or DEFAULT_MAX_PIXELS
    image_tokens = max_pixels // pixels_per_token
    patches = image_tokens * vision.spatial_merge_size ** 2
    block = training.max_length or 0
    images_per_block = max(block // max(image_tokens, 1), 1)
    optimizer_bytes = trainable * (4 + 8) / world_size  # fp32 gradient + AdamW moments, sharded
    if not model_args.freeze_vision_tower:
        activations = images_per_block * patches * vision.hidden_size * ACTIVATION_BYTES_PER_HIDDEN * vision.depth
    else:
        activations = images_per_block * patches * vision.hidden_size * 2 if model_args.train_vision_merger else 0
    added = (optimizer_bytes + activations) / GIB
    what = ("the whole tower trains" if not model_args.freeze_vision_tower else
            "tower frozen, merger trains" if model_args.train_vision_merger else "tower and merger frozen")
    return [
        f"  vision tower      {total:,} parameters ({what}: {trainable:,} trainable, the text plan counts them frozen)",
        f"  images            at most {image_tokens:,} image tokens per image (max_pixels {max_pixels:,} / "
        f"{pixels_per_token} pixels per token); a {block:,}-token block holds up to {images_per_block:,} such images",
        f"  vision memory     +{added:.2f} GiB per GPU on top of the table below (trained tower parameters' "
        f"grads + AdamW {optimizer_bytes / GIB:.2f}, tower activations for a block of images {activations / GIB:.2f})",
    ]
