"""Load the tokenizer and the model a recipe names, with the class its checkpoint declares.

Loading through `config.architectures` (not a fixed AutoModelForCausalLM) is what keeps a VLM-style
checkpoint such as qwen3_5 whole: the exported model has the architecture that came in.
"""

from __future__ import annotations

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

TINY_SCHEME = "tiny:"  # "tiny:llama" -> a tiny random stand-in built offline (sft_recipes.tiny)


def resolve_model_path(model_name_or_path: str) -> str:
    if model_name_or_path.startswith(TINY_SCHEME):
        from sft_recipes.tiny import ensure_tiny

        return ensure_tiny(model_name_or_path[len(TINY_SCHEME) :])
    return model_name_or_path


def model_config_of(model_args):
    """The recipe model's config.json: downloaded alone for a Hub id, never a weight; for `tiny:`,
    the stand-in's config without building it (every rank calls this before rank 0 builds it)."""
    if model_args.model_name_or_path.startswith(TINY_SCHEME):
        from sft_recipes.tiny import tiny_config

        return tiny_config(model_args.model_name_or_path[len(TINY_SCHEME) :])
    return AutoConfig.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision)


def load_tokenizer(model_args, model_path: str | None = None) -> PreTrainedTokenizerBase:
    path = model_path or resolve_model_path(model_args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path, revision=model_args.model_revision)
    if tokenizer.pad_token is None:
        # Base checkpoints (Llama-3.1-8B) ship no pad token. Padding never reaches the loss: the
        # collator sets labels to -100 on every padded position, whatever token fills them.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_class_for(config) -> type[PreTrainedModel]:
    """The class the checkpoint was saved from (e.g. Qwen3_5ForConditionalGeneration)."""
    for name in config.architectures or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM


def mxfp4_loading(config, dequantize_mxfp4: bool, path: str) -> transformers.Mxfp4Config | None:
    """`Mxfp4Config(dequantize=True)` for an MXFP4 checkpoint (gpt-oss), None for any other.

    MXFP4 weights cannot be trained (no gradients through the packed FP4 kernels), so an MXFP4
    checkpoint without `dequantize_mxfp4` is refused rather than loaded frozen or left to
    transformers' hardware-dependent fallback.
    """
    quantization = getattr(config, "quantization_config", None) or {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method
    if method != "mxfp4":
        return None
    if not dequantize_mxfp4:
        raise ValueError(
            f"{path} is an MXFP4-quantized checkpoint, which cannot be trained as it is: set `dequantize_mxfp4: true` "
            "in the recipe to load it dequantized to `dtype` (bfloat16 for gpt-oss)."
        )
    return transformers.Mxfp4Config(dequantize=True)


def load_model(model_args, model_path: str | None = None) -> PreTrainedModel:
    path = model_path or resolve_model_path(model_args.model_name_or_path)
    config = AutoConfig.from_pretrained(path, revision=model_args.model_revision)
    dtype = model_args.dtype if model_args.dtype in (None, "auto") else getattr(torch, model_args.dtype)
    model = model_class_for(config).from_pretrained(
        path,
        revision=model_args.model_revision,
        dtype=dtype,
        attn_implementation=model_args.attn_implementation,
        quantization_config=mxfp4_loading(config, model_args.dequantize_mxfp4, path),
    )
    # A KV cache is useless in training and disables transformers' packed-sequence detection.
    model.config.use_cache = False
    if hasattr(model.config, "text_config"):
        model.config.get_text_config().use_cache = False
    return model
