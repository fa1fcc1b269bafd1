"""Tiny offline stand-ins for the recipes' real models: config, tokenizer, checkpoint.

Each stand-in is the real architecture (read from ``shared/realworld/model_configs``) shrunk
to a few hundred thousand parameters, with a byte-level BPE tokenizer trained on the project's
own sample data and the real chat template attached, so every recipe has a CPU twin that differs
only in sizes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tokenizers
import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
)
from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
# The real configs and chat templates: a copy vendored into the repository wins over the
# team's shared folder next to the checkout.
REALWORLD_DIR = next(
    (path for path in (REPO_ROOT / "data" / "realworld", REPO_ROOT.parent / "shared" / "realworld") if path.is_dir()),
    REPO_ROOT.parent / "shared" / "realworld",
)
MODEL_TYPES = ("llama", "qwen3_5", "gpt_oss")

SAMPLES_DIR = REPO_ROOT / "data" / "samples"
DEFAULT_TINY_ROOT = REPO_ROOT / ".cache" / "tiny"
DEFAULT_VOCAB_SIZE = 512

REAL_CONFIG_FILES = {
    "llama": "meta-llama__Llama-3.1-8B.json",
    "qwen3_5": "Qwen__Qwen3.5-27B.derived.json",
    "gpt_oss": "openai__gpt-oss-120b.derived.json",
}

# Special tokens in the order the real vocabularies hold them (Llama 128000.., Qwen 151643..,
# harmony 199998..), so tiny ids are the real ids minus an offset. They are trained first and
# therefore get ids 0..n-1, which lets tiny_config know them without building a tokenizer.
SPECIAL_TOKENS = {
    "llama": [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|finetune_right_pad_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ],
    "qwen3_5": [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ],
    "gpt_oss": [
        "<|startoftext|>",
        "<|endoftext|>",
        "<|return|>",
        "<|constrain|>",
        "<|channel|>",
        "<|start|>",
        "<|end|>",
        "<|message|>",
        "<|call|>",
    ],
}

CHAT_TEMPLATE_FILES = {
    "llama": "meta-llama__Llama-3.1-8B-Instruct.jinja",
    # No unmodified Qwen3.5 template exists offline; Qwen3's is the same ChatML + <think> family.
    "qwen3_5": "Qwen__Qwen3-0.6B.jinja",
    "gpt_oss": "openai__gpt-oss-120b.jinja",
}

# Added tokens that the real tokenizer keeps as single ids but does not mark special, so
# decode(skip_special_tokens=True) keeps them (Qwen3's reasoning and tool tags).
PLAIN_ADDED_TOKENS = {
    "llama": [],
    "qwen3_5": ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"],
    "gpt_oss": [],
}

# Role of each special token for the tokenizer and the model config; None = the real one has none.
TOKEN_ROLES = {
    "llama": {"bos": "<|begin_of_text|>", "eos": "<|end_of_text|>", "pad": None},
    "qwen3_5": {"bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>"},
    "gpt_oss": {"bos": "<|startoftext|>", "eos": "<|return|>", "pad": "<|endoftext|>"},
}

# End-of-generation ids of the real generation_config.json files (ends of turn and of text).
_GENERATION_EOS = {
    "llama": ["<|end_of_text|>"],
    "qwen3_5": ["<|im_end|>", "<|endoftext|>"],
    "gpt_oss": ["<|return|>", "<|endoftext|>"],
}

AUTO_MODEL_CLASSES = {
    "llama": AutoModelForCausalLM,
    # The real checkpoint is the vision-language model; AutoModelForCausalLM would drop the vision tower.
    "qwen3_5": AutoModelForImageTextToText,
    "gpt_oss": AutoModelForCausalLM,
}

_QWEN3_5_VISION_TOKENS = {
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
}
# tiny_config overrides that belong to the top-level config rather than to the text model.
_TOP_LEVEL_KEYS = {"qwen3_5": ("vision_config", *_QWEN3_5_VISION_TOKENS)}

# Sizes only: everything else (rope type and scaling, layer pattern, biases, tying, MoE routing,
# sliding window kind) comes from the real config. Head counts keep the real GQA group sizes
# (Llama 32:8, Qwen3.5 24:4 and linear 16:48, gpt-oss 64:8) and the real "heads * head_dim vs
# hidden" relation (equal for Llama, larger for Qwen3.5 and gpt-oss).
_TINY_TEXT_SIZES = {
    "llama": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=8,
    ),
    "qwen3_5": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=6, num_key_value_heads=1, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=6,
        linear_key_head_dim=16, linear_value_head_dim=16,
    ),
    "gpt_oss": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=1, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, experts_per_token=2,
        # Short enough that the tiny sample sequences actually cross the window.
        sliding_window=16,
    ),
}

# out_hidden_size is set to the text hidden size in tiny_config (the merger feeds the text tower).
_TINY_QWEN3_5_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, num_position_embeddings=64)

# The tiny twin's image bounds: 32x32 to 128x128 pixels, i.e. 1 to 16 image tokens (16-pixel patches, 2x2 merged).
TINY_MIN_PIXELS, TINY_MAX_PIXELS = 32 * 32, 128 * 128

# Keys of the real files that do not describe the architecture of a float32 CPU twin.
_DROPPED_KEYS = ("quantization_config", "transformers_version", "torch_dtype")


def real_config_dict(model_type: str) -> dict[str, Any]:
    """The real (or derived) config.json of the recipe's model, as a dict."""
    _check_model_type(model_type)
    return json.loads((REALWORLD_DIR / "model_configs" / REAL_CONFIG_FILES[model_type]).read_text())


def special_token_id(family: str, token: str) -> int:
    """Id of a special token in the tiny tokenizer of ``family`` (they are trained first)."""
    return SPECIAL_TOKENS[family].index(token)


def tiny_config(model_type: str, vocab_size: int = DEFAULT_VOCAB_SIZE, **overrides: Any) -> PretrainedConfig:
    """A tiny config of the real architecture ``model_type``.

    ``overrides`` set text-model fields (for qwen3_5: of ``text_config``; ``vision_config`` and the
    vision token ids stay top-level). Changing ``num_hidden_layers`` re-cuts ``layer_types`` from
    the real pattern.
    """
    _check_model_type(model_type)
    real = real_config_dict(model_type)
    for key in _DROPPED_KEYS:
        real.pop(key, None)
    top_overrides = {k: overrides.pop(k) for k in list(overrides) if k in _TOP_LEVEL_KEYS.get(model_type, ())}

    text = real["text_config"] if model_type == "qwen3_5" else real
    text.update(_TINY_TEXT_SIZES[model_type])
    text.update(vocab_size=vocab_size, use_cache=False, attention_dropout=0.0, **_token_ids(model_type))
    text.update(overrides)
    if "layer_types" in text and "layer_types" not in overrides:
        text["layer_types"] = _real_layer_pattern(model_type, text["num_hidden_layers"])

    if model_type == "qwen3_5":
        real["vision_config"] = dict(_TINY_QWEN3_5_VISION, out_hidden_size=text["hidden_size"])
        real["text_config"]["rope_parameters"] = _qwen3_5_rope(text)
        real.update({key: special_token_id("qwen3_5", tok) for key, tok in _QWEN3_5_VISION_TOKENS.items()})
        real.update(use_cache=False, tie_word_embeddings=text["tie_word_embeddings"], **_token_ids(model_type))
        real.update(top_overrides)

    config = AutoConfig.for_model(**real)
    config.dtype = "float32"
    _check_overrides_exist(config, overrides, model_type)
    return config



def _check_model_type(model_type: str) -> None:
    if model_type not in MODEL_TYPES:
        raise ValueError(f"Unknown tiny model_type {model_type!r}; choose one of {', '.join(MODEL_TYPES)}.")


def _check_overrides_exist(config: PretrainedConfig, overrides: dict[str, Any], model_type: str) -> None:
    # PretrainedConfig silently keeps unknown kwargs, so a typo would otherwise pass unnoticed.
    text = config.get_text_config()
    unknown = [key for key in overrides if key not in type(text).__dataclass_fields__]
    if unknown:
        raise ValueError(
            f"tiny_config({model_type!r}) got unknown override(s) {unknown}; "
            f"use fields of {type(text).__name__}."
        )


def _token_ids(model_type: str) -> dict[str, int | None]:
    roles = TOKEN_ROLES[model_type]
    return {
        f"{role}_token_id": None if token is None else special_token_id(model_type, token)
        for role, token in roles.items()
    }


def _real_text_config(model_type: str) -> dict[str, Any]:
    real = real_config_dict(model_type)
    return real.get("text_config", real)


def _real_layer_pattern(model_type: str, num_layers: int) -> list[str]:
    pattern = _real_text_config(model_type)["layer_types"]
    assert num_layers <= len(pattern), "tiny models never have more layers than the real one"
    return pattern[:num_layers]


def _qwen3_5_rope(text: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's interleaved M-RoPE with sections scaled to the tiny rotary width.

    The real sections [11, 11, 10] (t, h, w) fill 32 frequencies = 256 * 0.25 / 2; the modelling
    code defaults to them, which would silently index past a tiny head.
    """
    partial_rotary_factor = 0.25
    frequencies = int(text["head_dim"] * partial_rotary_factor) // 2
    height = width = frequencies // 3
    return {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": partial_rotary_factor,
        "mrope_interleaved": True,
        "mrope_section": [frequencies - height - width, height, width],
    }


def sample_files() -> list[Path]:
    """The committed sample datasets (written by scripts/make_sample_data.py)."""
    files = sorted(SAMPLES_DIR.glob("*.jsonl"))
    if not files:
        raise ValueError(f"No sample data in {SAMPLES_DIR}; run scripts/make_sample_data.py first.")
    return files


def sample_texts() -> Iterator[str]:
    """Every string in the sample datasets, in file and row order (the tokenizer's corpus)."""
    for path in sample_files():
        for line in path.read_text(encoding="utf-8").splitlines():
            yield from strings_in(json.loads(line))


def strings_in(value: Any) -> Iterator[str]:
    """Every string inside a JSON value (dict values and list items, recursively), in order."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings_in(item)


def build_tokenizer(
    family: str, out_dir: str | Path | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the sample data, with the family's real chat template.

    The family's special tokens get ids 0..n-1 (see ``SPECIAL_TOKENS``); bos/eos/pad follow the
    real tokenizer (Llama: no pad, and bos is prepended on encode like the real one).
    """
    _check_model_type(family)
    plain_tokens = PLAIN_ADDED_TOKENS[family]
    backend = Tokenizer(models.BPE())
    # AutoTokenizer loads qwen3_5 checkpoints with Qwen3_5Tokenizer, which rebuilds its own
    # normalizer and pre-tokenizer, so train every family with exactly those (single-digit
    # splitting also keeps the arithmetic samples learnable).
    qwen_backend = Qwen3_5Tokenizer().backend_tokenizer
    backend.normalizer = qwen_backend.normalizer
    backend.pre_tokenizer = qwen_backend.pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(plain_tokens),
        special_tokens=[AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS[family]],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(sample_texts(), trainer=trainer)
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in plain_tokens])

    roles = TOKEN_ROLES[family]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=roles["bos"],
        eos_token=roles["eos"],
        pad_token=roles["pad"],
        add_bos_token=family == "llama",
        chat_template=(REALWORLD_DIR / "chat_templates" / CHAT_TEMPLATE_FILES[family]).read_text(),
        model_max_length=_real_text_config(family)["max_position_embeddings"],
    )
    assert len(tokenizer) <= vocab_size, "the tiny model's embedding must cover every token id"
    if out_dir is not None:
        tokenizer.save_pretrained(out_dir)
    return tokenizer


def build_tiny_model(model_type: str, out_dir: str | Path, seed: int = 0) -> str:
    """Write a randomly initialised tiny checkpoint (weights, configs, tokenizer) to ``out_dir``.

    Same ``seed`` -> identical weights. Load it with ``AUTO_MODEL_CLASSES[model_type]``.
    """
    config = tiny_config(model_type)
    tokenizer = build_tokenizer(model_type)
    torch.manual_seed(seed)
    model = AUTO_MODEL_CLASSES[model_type].from_config(config, dtype=torch.float32)
    model.generation_config = _generation_config(model_type)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if model_type == "qwen3_5":  # the real checkpoint ships its image processor (preprocessor_config.json)
        tiny_image_processor(config).save_pretrained(out_dir)
    return str(out_dir)


def tiny_image_processor(config: PretrainedConfig):
    """The PIL image processor of the real Qwen3.5 checkpoint's kind (``Qwen2VLImageProcessor``; AutoImageProcessor
    loads this PIL variant without torchvision), sized to the twin's vision tower and bounded to few image tokens."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vision = config.vision_config
    return Qwen2VLImageProcessorPil(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                                    merge_size=vision.spatial_merge_size,
                                    size={"shortest_edge": TINY_MIN_PIXELS, "longest_edge": TINY_MAX_PIXELS})


def ensure_tiny(model_type: str, root: str | Path = DEFAULT_TINY_ROOT, seed: int = 0) -> str:
    """Path of the tiny checkpoint for ``model_type``, built on first use and reused after.

    The directory name carries a hash of everything the build reads (this module, the sample data,
    the real config and template, library versions), so any change rebuilds instead of reusing.
    Safe under concurrent callers (e.g. every rank of a launch): each builds aside and renames.
    """
    _check_model_type(model_type)
    root = Path(root)
    target = root / f"{model_type}-seed{seed}-{_build_key(model_type, seed)}"
    if (target / "config.json").exists():
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache is shared by every user of the clone
    build_tiny_model(model_type, staging, seed=seed)
    if not (staging / "config.json").exists():
        # transformers' save_pretrained writes nothing on ranks other than 0 once torch.distributed
        # is initialised; never publish such a half-built directory.
        shutil.rmtree(staging)
        raise RuntimeError(
            f"Could not build the tiny {model_type} model on this rank: build it on rank 0 first "
            "(scripts/sft.py does, under main_process_first) or run scripts/make_tiny.py beforehand."
        )
    try:
        os.rename(staging, target)
    except OSError:
        # Another process finished first; its build is identical (same key, deterministic).
        shutil.rmtree(staging)
    return str(target)


def _build_key(model_type: str, seed: int) -> str:
    digest = hashlib.sha256()
    inputs = [
        Path(__file__),
        REALWORLD_DIR / "model_configs" / REAL_CONFIG_FILES[model_type],
        REALWORLD_DIR / "chat_templates" / CHAT_TEMPLATE_FILES[model_type],
        *sample_files(),
    ]
    for path in inputs:
        digest.update(path.read_bytes())
    digest.update(f"{seed}|{torch.__version__}|{transformers.__version__}|{tokenizers.__version__}".encode())
    return digest.hexdigest()[:12]


def _generation_config(model_type: str) -> GenerationConfig:
    roles = TOKEN_ROLES[model_type]
    eos_ids = [special_token_id(model_type, token) for token in _GENERATION_EOS[model_type]]
    return GenerationConfig(
        bos_token_id=None if roles["bos"] is None else special_token_id(model_type, roles["bos"]),
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        pad_token_id=None if roles["pad"] is None else special_token_id(model_type, roles["pad"]),
    )
