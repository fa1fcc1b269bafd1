"""The packing preflight: prove on a tiny random copy of the architecture that packing does not leak.

Runs in seconds on CPU: the recipe's config shrunk (sizes only; layer pattern, head dims, rope,
conv width and the other structure stay real), a random model with any leak made large
(``PackingQuirk.expose_leaks``), prepared exactly as training prepares it, then three examples
packed in one row against the same examples run alone.
"""

from __future__ import annotations

import logging

import torch
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, PretrainedConfig

from sft_recipes.data.collator import pack_kwargs
from sft_recipes.architectures.registry import PACKING_QUIRKS, prepare_for_packing
from sft_recipes.errors import RecipeError

logger = logging.getLogger(__name__)

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
) -> None:
    """Raise ValueError, naming the fix, if packed training of this architecture would leak.

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
            f"{attention!r}: examples packed in one row differ from the same examples run alone by up to "
            f"{difference:.2e} (tolerance {tolerance:.0e}). Turn packing off for this recipe, or add a fix for "
            f"{model.config.model_type!r} to sft_recipes.architectures.registry.PACKING_QUIRKS until this check passes."
        )
    logger.info(
        "packing preflight passed for %s (attention %s, requested %s): max |packed - separate| = %.1e",
        config.model_type, attention, attn_implementation, difference,
    )


def packed_vs_separate_difference(model: torch.nn.Module, lengths: tuple[int, ...]) -> float:
    """Max |difference| of logits and loss between ``lengths``-long random examples packed and alone."""
    generator = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    examples = [torch.randint(0, model.config.vocab_size, (n,), generator=generator).to(device) for n in lengths]
    row = torch.cat(examples).unsqueeze(0)
    packed_kwargs = {
        key: value.to(device) if torch.is_tensor(value) else value
        for key, value in pack_kwargs(lengths, labels=row).items()
    }
    with torch.no_grad():
        packed = model(input_ids=row, use_cache=False, **packed_kwargs)
        alone = [model(input_ids=ids.unsqueeze(0), labels=ids.unsqueeze(0), use_cache=False) for ids in examples]
    separate_logits = torch.cat([output.logits[0] for output in alone])
    # Each example contributes len - 1 targets, packed or alone, so the packed mean is this weighted mean.
    targets = torch.tensor(lengths, device=device) - 1
    separate_loss = (torch.stack([output.loss for output in alone]) * targets).sum() / targets.sum()
    return max((packed.logits[0] - separate_logits).abs().max().item(), (packed.loss - separate_loss).abs().item())


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
