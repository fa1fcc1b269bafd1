"""The output head shares an FSDP unit with the text decoder's final norm, for every recipe architecture.

accelerate 1.15 shards ``[final norm, lm_head]`` as one unit but looks for the norm only among
``base_model``'s direct children; the Qwen3.5 VLM's is one level deeper. Its lm_head then became a
unit of its own that TRL's fused head never gathers, whose gradient no rank reduced: the end-to-end
proof is `test_qwen_fsdp.py::test_two_processes_train_like_one_on_the_same_global_batch`.
"""

from __future__ import annotations

import accelerate.utils.fsdp_utils
import pytest
import torch

from sft_recipes.fsdp_wrap import group_output_head_with_final_norm, resolve_fsdp_wrap_classes, text_decoder_final_norm
from sft_recipes.tiny import AUTO_MODEL_CLASSES, tiny_config


def tiny_model(model_type: str) -> torch.nn.Module:
    return AUTO_MODEL_CLASSES[model_type].from_config(tiny_config(model_type), dtype=torch.float32)


@pytest.mark.parametrize(
    ("model_type", "norm_path"),
    [("llama", "model.norm"), ("gpt_oss", "model.norm"), ("qwen3_5", "model.language_model.norm")],
)
def test_the_final_norm_is_the_text_decoder_s_last_norm(model_type, norm_path):
    model = tiny_model(model_type)
    assert text_decoder_final_norm(model) is model.get_submodule(norm_path)


def test_accelerate_finds_the_vlm_s_final_norm_once_grouped():
    qwen, llama = tiny_model("qwen3_5"), tiny_model("llama")
    group_output_head_with_final_norm()
    group_output_head_with_final_norm()  # idempotent: one wrapper, not two
    find = accelerate.utils.fsdp_utils._find_final_norm
    upstream = find.__wrapped__
    assert not hasattr(upstream, "__wrapped__")
    assert upstream(qwen) is None  # accelerate's own search: base_model's children (visual, language_model)
    assert find(qwen) is qwen.model.language_model.norm
    assert find(llama) is upstream(llama) is llama.model.norm  # where upstream finds it, its answer stands


def test_a_set_of_unit_classes_resolves_in_one_order_whatever_the_hash_seed():
    # transformers 5 keeps a composite model's _no_split_modules as a set (the qwen3_5 VLM's two block classes), whose
    # order changes with PYTHONHASHSEED: the compile line and the pinned env var once differed between CI runs
    names = [f"Block{letter}" for letter in "HCFADGBE"]
    model = torch.nn.Sequential(*(type(name, (torch.nn.Module,), {})() for name in names))
    model._no_split_modules = set(names)
    assert resolve_fsdp_wrap_classes(model) == sorted(names)
    qwen = tiny_model("qwen3_5")
    assert isinstance(qwen._no_split_modules, set)
    assert resolve_fsdp_wrap_classes(qwen) == ["Qwen3_5DecoderLayer", "Qwen3_5VisionBlock"]
