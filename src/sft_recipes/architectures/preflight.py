"""The packing preflight: prove on a tiny random copy of the architecture that packing does not leak.

Runs in seconds on CPU: the recipe's config shrunk (sizes only; layer pattern, head dims, rope,
conv width and the other structure stay real), a random model with any leak made large
(``PackingQuirk.expose_leaks``), prepared exactly as training prepares it, then three examples
packed in a batch of two rows against the same examples run alone.
"""

from __future__ import annotations

import torch
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, PretrainedConfig

from sft_recipes.data.collator import BlockDiagonalCollator
from sft_recipes.architectures.registry import PACKING_QUIRKS, prepare_for_packing
from sft_recipes.errors import RecipeError

# Lengths of the probe examples: longer than the conv width and the shrunk sliding window, so
# a bleed at either would show, and unequal, so no boundary lines up by accident.
PROBE_LENGTHS = (11, 6, 9)
# fp32 on CPU agrees to ~1e-6; GPU kernels (tf32 inside fla) stay far below this, and the leaks
# that exposed random models show are > 1e-1.
DEFAULT_TOLERANCE = 1e-3

_TINY_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "vocab_size": 256,
    "num_local_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "experts_per_token": 2,
    "num_key_value_heads": 1,
    "linear_num_key_heads": 1,
    "sliding_window": 4,
}
_CHECKABLE_ATTENTION = ("eager", "sdpa")
# Ids of the real vocabulary would index past the tiny embedding.
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def check_packing_leak(
    config: PretrainedConfig, attn_implementation: str | None, tolerance: float = DEFAULT_TOLERANCE
) -> str:
    """Raise ValueError, naming the fix, if packed training of this architecture would leak; else the line
    that says it passed.

    ``attn_implementation`` is the one training uses. The check runs it when it is ``eager`` or
    ``sdpa``; flash-attention and hub kernels need half precision on a GPU and flex attention
    compiles for minutes on CPU, so for those it runs the model's default (sdpa, else eager)
    instead. Flash keeps examples apart through ``cu_seq_lens`` and flex through the same
    packed-sequence masks as sdpa; what can still leak -- masks, convolutions, recurrent state --
    is what the check covers.
    """
    tiny = shrink_config(config)
    checked_attention = attn_implementation if attn_implementation in _CHECKABLE_ATTENTION else None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny, attn_implementation=checked_attention, dtype=torch.float32)
    model.to(device).eval()
    quirk = PACKING_QUIRKS.get(model.config.model_type)
    if quirk is not None and quirk.expose_leaks is not None:
        quirk.expose_leaks(model)
    prepare_for_packing(model)

    difference = packed_vs_separate_difference(model, PROBE_LENGTHS)
    attention = model.config._attn_implementation
    if difference > tolerance:
        raise RecipeError(
            f"Packed examples leak into each other for model_type {config.model_type!r} with attention "
            f"{attention!r}: examples packed in a batch differ from the same examples run alone by up to "
            f"{difference:.2e} (tolerance {tolerance:.0e}). Turn packing off for this recipe, or add a fix for "
            f"{model.config.model_type!r} to sft_recipes.architectures.registry.PACKING_QUIRKS until this check passes."
        )
    return (f"packing preflight passed for {config.model_type} (attention {attention}, requested "
            f"{attn_implementation}): max |packed - separate| = {difference:.1e}")


def packed_vs_separate_difference(model: torch.nn.Module, lengths: tuple[int, ...]) -> float:
    """Max |difference| of logits and loss between ``lengths``-long random examples packed and alone.

    Packed as a device batch of two blocks, as training gives a model ``per_device_train_batch_size`` > 1: the
    first two examples in one row, the rest in a second row padded to the same length (a kernel that takes
    ``cu_seqlens`` only for one row, as fla's does, is exercised the way training uses it).
    """
    generator = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    examples = [torch.randint(0, model.config.vocab_size, (n,), generator=generator) for n in lengths]
    blocks = [{"input_ids": torch.cat(part).tolist(), "seq_lengths": [len(e) for e in part]}
              for part in (examples[:2], examples[2:])]
    width = max(len(block["input_ids"]) for block in blocks)
    batch = BlockDiagonalCollator(width, pad_token_id=0, block_per_row=True)(blocks)
    batch = {key: value.to(device) if torch.is_tensor(value) else value for key, value in batch.items()}
    with torch.no_grad():
        packed = model(**batch, use_cache=False)
        alone = [model(input_ids=ids.to(device).unsqueeze(0), labels=ids.to(device).unsqueeze(0), use_cache=False)
                 for ids in examples]
    places = [(0, 0), (0, lengths[0]), *((1, sum(lengths[2:i])) for i in range(2, len(lengths)))]
    logit_difference = max(
        (packed.logits[row, start : start + len(ids)] - output.logits[0]).abs().max().item()
        for (row, start), ids, output in zip(places, examples, alone)
    )
    # Each example contributes len - 1 targets, packed or alone, so the packed mean is this weighted mean.
    targets = torch.tensor(lengths, device=device) - 1
    separate_loss = (torch.stack([output.loss for output in alone]) * targets).sum() / targets.sum()
    return max(logit_difference, (packed.loss - separate_loss).abs().item())


def shrink_config(config: PretrainedConfig) -> PretrainedConfig:
    """The text model of ``config`` with tiny sizes and its real structure (a few seconds on CPU)."""
    real = config.get_text_config()
    text = real.to_dict()
    text.pop("quantization_config", None)
    for key, value in _TINY_SIZES.items():
        if text.get(key) is not None:
            text[key] = value if key != "sliding_window" else min(value, text[key])
    # Keep the real query/kv and value/key head ratios and the real head dims (rope depends on them).
    text["num_attention_heads"] = real.num_attention_heads // real.num_key_value_heads
    heads = text["num_attention_heads"]
    if text["hidden_size"] % heads and "validate_architecture" in vars(CONFIG_MAPPING[text["model_type"]]):
        # e.g. LlamaConfig refuses a hidden size its heads do not divide (SmolLM2: 9:3 heads -> 3 here)
        text["hidden_size"] = heads * -(-text["hidden_size"] // heads)
    if text.get("linear_num_value_heads") is not None:
        text["linear_num_value_heads"] = real.linear_num_value_heads // real.linear_num_key_heads
    if text.get("head_dim") is None:
        text["head_dim"] = real.hidden_size // real.num_attention_heads
    text.update({key: None for key in _TOKEN_ID_KEYS})
    layer_types = text.get("layer_types")
    if layer_types:
        # The shortest prefix of the real pattern that holds every kind of layer.
        needed = max(layer_types.index(kind) for kind in set(layer_types)) + 1
        text["layer_types"] = layer_types[:needed]
        text["num_hidden_layers"] = needed
    else:
        text["num_hidden_layers"] = 2
    model_type = text.pop("model_type")
    return AutoConfig.for_model(model_type, **text)


# ── Image + text packing (dataset_format: vision_messages) ───────────────────────────────────────

# The probe's images as (t, h, w) patch grids: two images in one example, a text-only example between.
PROBE_IMAGE_GRIDS = (((1, 4, 6),), (), ((1, 4, 4), (1, 2, 2)))
_TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, num_position_embeddings=64)


def check_image_packing_leak(config: PretrainedConfig, tolerance: float = DEFAULT_TOLERANCE) -> str:
    """Raise RecipeError if packed image + text blocks of this VLM would differ from their examples run alone;
    else the line that says it passed.

    The recipe's config shrunk (text tower as for text packing, a tiny vision tower of the same kind), random
    weights with leaks exposed, prepared as training prepares it; the probe's examples are collated by the
    same `VisionBlockCollator` the run uses, and each example alone goes through the model's own path
    (``mm_token_type_ids``: the model computes its positions itself).
    """
    from transformers import AutoModelForImageTextToText

    from sft_recipes.architectures.qwen3_5 import prepare_for_image_packing

    tiny = tiny_vlm_config(config)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(tiny, attn_implementation="sdpa", dtype=torch.float32)
    model.to(device).eval()
    quirk = PACKING_QUIRKS.get(model.config.model_type)
    if quirk is not None and quirk.expose_leaks is not None:
        quirk.expose_leaks(model)
    prepare_for_packing(model)
    prepare_for_image_packing(model)
    difference = image_packed_vs_separate_difference(model, probe_image_examples(tiny))
    if difference > tolerance:
        raise RecipeError(
            f"Packed image + text examples leak into each other for model_type {config.model_type!r}: a packed block "
            f"differs from its examples run alone by up to {difference:.2e} (tolerance {tolerance:.0e}). Turn "
            "pack_blocks off for this image recipe, or fix sft_recipes.data.vision (positions, image order) and "
            "architectures.qwen3_5.prepare_for_image_packing until this check passes."
        )
    return f"image packing preflight passed for {config.model_type}: max |packed - separate| = {difference:.1e}"


def tiny_vlm_config(config: PretrainedConfig) -> PretrainedConfig:
    """The VLM ``config`` with its text model shrunk as `shrink_config` does and a tiny vision tower of its kind."""
    text = shrink_config(config).to_dict()
    vision = {**config.vision_config.to_dict(), **_TINY_VISION, "out_hidden_size": text["hidden_size"]}
    text["vocab_size"] = max(text["vocab_size"], 16)
    full = {**config.to_dict(), "text_config": text, "vision_config": vision}
    # The vision token ids index the tiny embedding: put them at its top.
    for offset, key in enumerate(("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")):
        full[key] = text["vocab_size"] - 1 - offset
    for key in ("quantization_config", "transformers_version"):
        full.pop(key, None)
    return AutoConfig.for_model(**full)


def probe_image_examples(config: PretrainedConfig, text_lengths: tuple[int, ...] = PROBE_LENGTHS):
    """Random `VisionExample`s: ``text_lengths`` text tokens, each image's tokens after the first few (between
    vision start/end tokens), random patches; positions from `vision.mrope_positions`."""
    from sft_recipes.data.vision import VisionExample, mrope_positions

    generator = torch.Generator().manual_seed(0)
    vision = config.vision_config
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    text_vocab = config.vision_end_token_id - 3  # plain text ids stay below the four vision ids
    examples = []
    for length, grids in zip(text_lengths, PROBE_IMAGE_GRIDS):
        ids = torch.randint(0, text_vocab, (length,), generator=generator).tolist()
        for grid in grids:
            tokens = grid[0] * grid[1] * grid[2] // vision.spatial_merge_size ** 2
            ids[2:2] = [config.vision_start_token_id, *[config.image_token_id] * tokens, config.vision_end_token_id]
        labels = [token if token < text_vocab and index > len(ids) // 2 else -100 for index, token in enumerate(ids)]
        grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        pixels = torch.randn(int(grid.prod(-1).sum()), width, generator=generator)
        examples.append(VisionExample(ids, labels, pixels, grid, mrope_positions(config, torch.tensor(ids), grid)))
    return examples


def image_packed_vs_separate_difference(model: torch.nn.Module, examples, pad: int = 5) -> float:
    """Max |difference| of logits and loss between `examples` packed in one block (with a padding tail) and alone."""
    from sft_recipes.data.blocks import join_examples
    from sft_recipes.data.vision import VisionBlockCollator

    device = next(model.parameters()).device
    block = join_examples([vars(example) for example in examples])
    length = len(block["input_ids"]) + pad
    batch = VisionBlockCollator(length, pad_token_id=0)([block])
    batch = {key: value.to(device) if torch.is_tensor(value) else value for key, value in batch.items()}
    with torch.no_grad():
        packed = model(**batch, use_cache=False)
        alone = [model(**example_inputs(example, model.config, device), use_cache=False) for example in examples]
    separate_logits = torch.cat([output.logits[0] for output in alone])
    targets = torch.tensor([sum(label != -100 for label in example.labels[1:]) for example in examples], device=device)
    separate_loss = (torch.stack([output.loss for output in alone]) * targets).sum() / targets.sum()
    real = separate_logits.shape[0]
    return max((packed.logits[0, :real] - separate_logits).abs().max().item(), (packed.loss - separate_loss).abs().item())


def example_inputs(example, config: PretrainedConfig, device) -> dict:
    """One example as the model takes it alone: its own path computes the positions (``mm_token_type_ids``)."""
    ids = torch.tensor([example.input_ids], device=device)
    inputs = {"input_ids": ids, "labels": torch.tensor([example.labels], device=device)}
    if example.image_grid_thw.numel():
        inputs.update(pixel_values=example.pixel_values.to(device), image_grid_thw=example.image_grid_thw.to(device),
                      mm_token_type_ids=(ids == config.image_token_id).int())
    return inputs
