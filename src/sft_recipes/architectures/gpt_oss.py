"""gpt_oss: build its attention masks from ``position_ids``, so packed examples stay apart.

transformers 5.23's ``GptOssModel.forward`` calls ``create_causal_mask`` and
``create_sliding_window_causal_mask`` without ``position_ids`` (every other decoder passes them),
so the packed-sequence detection in ``masking_utils`` never runs: with eager or flex attention each
example attends to the ones before it in the row. The fix is that missing argument: a forward
pre-hook on the ``GptOssModel`` instance builds the same two masks with ``position_ids`` and hands
them in as the prepared ``{layer_type: mask}`` dict the forward already accepts. Everything else
(causality, the sliding window of the sliding layers, padding, flash's own varlen path) stays
transformers' logic.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssModel

# Marks a GptOssModel whose hook is already registered, so preparing twice is harmless.
_HOOKED = "_sft_recipes_packed_masks"


def install_packed_masks(model: torch.nn.Module) -> None:
    """Register the mask-building pre-hook on every ``GptOssModel`` inside ``model``. Idempotent."""
    decoders = [module for module in model.modules() if isinstance(module, GptOssModel)]
    assert decoders, "a gpt_oss model always contains a GptOssModel"
    for decoder in decoders:
        if not getattr(decoder, _HOOKED, False):
            decoder.register_forward_pre_hook(_masks_from_position_ids, with_kwargs=True)
            setattr(decoder, _HOOKED, True)


def _masks_from_position_ids(
    decoder: GptOssModel, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]] | None:
    position_ids = kwargs.get("position_ids")
    # Without positions, with an explicit mask or with a cache (generation) gpt_oss already
    # behaves like every other decoder. GptOssForCausalLM calls its decoder with keywords only.
    upstream_is_right = position_ids is None or any(
        kwargs.get(key) is not None for key in ("attention_mask", "past_key_values")
    )
    if args or upstream_is_right:
        return None
    inputs_embeds = kwargs.get("inputs_embeds")
    if inputs_embeds is None:
        # The mask builders read only batch size, length, dtype and device from the embeddings.
        input_ids = kwargs["input_ids"]
        inputs_embeds = torch.empty(
            (*input_ids.shape, 0), dtype=decoder.embed_tokens.weight.dtype, device=input_ids.device
        )
    mask_kwargs = {
        "config": decoder.config,
        "inputs_embeds": inputs_embeds,
        "attention_mask": None,
        "past_key_values": None,
        "position_ids": position_ids,
    }
    masks = {
        "full_attention": create_causal_mask(**mask_kwargs),
        "sliding_attention": create_sliding_window_causal_mask(**mask_kwargs),
    }
    return args, {**kwargs, "attention_mask": masks}
