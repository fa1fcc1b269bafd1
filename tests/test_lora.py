"""LoRA from the recipe on the tiny GPT-OSS twin: the ranks really applied, the warnings, the errors.

The tiny twin has the real architecture at hidden 64: q_proj 64->128, k/v_proj 64->16, o_proj
128->64, and 4 experts with gate_up_proj [4, 64, 256] and down_proj [4, 128, 64].
"""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import get_peft_model, get_peft_model_state_dict
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from transformers import AutoModelForCausalLM

from conftest import REPO_ROOT
from sft_recipes.config import RecipeError, load_recipe
from sft_recipes.lora import AppliedLora, apply_lora, applied_lora, build_lora_config, format_lora_table
from sft_recipes.tiny import ensure_tiny

TWIN = REPO_ROOT / "recipes" / "tiny" / "gptoss120b.yaml"
FALSE_WARNING = "did not match any targeted module"


@pytest.fixture(scope="module")
def model_args():
    return load_recipe(TWIN).model


def tiny_gpt_oss() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(ensure_tiny("gpt_oss"))


@pytest.fixture(scope="module")
def lora_model(model_args):
    return apply_lora(tiny_gpt_oss(), build_lora_config(model_args), seed=0)


def test_recipe_says_everything_peft_can(model_args):
    config = build_lora_config(model_args)
    assert (config.r, config.lora_alpha, config.lora_dropout) == (32, 32, 0.0)
    assert config.target_modules == "all-linear"
    assert config.target_parameters == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert config.rank_pattern == {"mlp.experts.gate_up_proj": 8, "mlp.experts.down_proj": 8}


def test_ranks_read_off_the_weights(lora_model):
    applied = {(lora.target, lora.rank, lora.num_experts, lora.a_shape, lora.b_shape) for lora in applied_lora(lora_model)}
    expected = set()
    for layer in (0, 1):
        prefix = f"model.layers.{layer}"
        expected |= {
            (f"{prefix}.self_attn.q_proj", 32, 1, (32, 64), (128, 32)),
            (f"{prefix}.self_attn.k_proj", 32, 1, (32, 64), (16, 32)),
            (f"{prefix}.self_attn.v_proj", 32, 1, (32, 64), (16, 32)),
            (f"{prefix}.self_attn.o_proj", 32, 1, (32, 128), (64, 32)),
            # rank 8 per expert: peft stacks the 4 experts' rank blocks, 8 x 4 = 32 rows of lora_A
            (f"{prefix}.mlp.experts.gate_up_proj", 8, 4, (32, 64), (256, 32)),
            (f"{prefix}.mlp.experts.down_proj", 8, 4, (32, 128), (64, 32)),
        }
    assert applied == expected


def test_only_lora_weights_train(lora_model):
    trainable = {name for name, param in lora_model.named_parameters() if param.requires_grad}
    assert len(trainable) == 24  # 12 targets x (lora_A, lora_B)
    assert all(".lora_A." in name or ".lora_B." in name for name in trainable)
    frozen = [name for name, param in lora_model.named_parameters() if not param.requires_grad]
    assert any(name.endswith("mlp.router.weight") for name in frozen)
    assert any(name.endswith("self_attn.sinks") for name in frozen)


def test_table_folds_layers():
    applied = [
        AppliedLora("model.layers.0.self_attn.q_proj", 32, 32, 1, (32, 64), (128, 32)),
        AppliedLora("model.layers.1.self_attn.q_proj", 32, 32, 1, (32, 64), (128, 32)),
        AppliedLora("model.layers.0.mlp.experts.down_proj", 8, 32, 4, (32, 128), (64, 32)),
    ]
    model = torch.nn.Linear(10, 10)  # 110 parameters, all trainable
    assert format_lora_table(applied, model).splitlines() == [
        "  model.layers.*.self_attn.q_proj       r=32  alpha=32   x2",
        "  model.layers.*.mlp.experts.down_proj  r=8   alpha=32   x1 (4 experts, A [32, 128])",
        "  trainable 110 of 110 parameters (100.000%)",
    ]


def test_peft_false_pattern_warning_is_replaced_by_the_real_check(model_args):
    # peft 0.21.2 claims the expert keys "did not match", yet applies them (see test_ranks_read_off_the_weights).
    with pytest.warns(RuntimeWarning, match=FALSE_WARNING):
        get_peft_model(tiny_gpt_oss(), build_lora_config(model_args))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        apply_lora(tiny_gpt_oss(), build_lora_config(model_args), seed=0)


def test_a_pattern_key_that_matches_nothing_is_an_error(model_args):
    recipe = load_recipe(TWIN, {"lora_rank_pattern": {"mlp.experts.up_proj": 8}})
    unmatched = r"lora_rank_pattern key\(s\) \['mlp.experts.up_proj'\] match no LoRA target"
    with pytest.raises(ValueError, match=unmatched) as error:
        apply_lora(tiny_gpt_oss(), build_lora_config(recipe.model), seed=0)
    assert "model.layers.*.mlp.experts.gate_up_proj" in str(error.value)  # names what exists


def test_dropout_with_target_parameters_is_a_recipe_error():
    with pytest.raises(RecipeError,
                       match=r"lora_dropout=0.1 cannot be used with lora_target_parameters.*`lora_dropout: 0.0`"):
        load_recipe(TWIN, {"lora_dropout": 0.1})


def test_the_adapter_init_comes_from_the_seed(model_args, lora_model):
    again = apply_lora(tiny_gpt_oss(), build_lora_config(model_args), seed=0)
    other = apply_lora(tiny_gpt_oss(), build_lora_config(model_args), seed=1)
    first, second, third = (get_peft_model_state_dict(m) for m in (lora_model, again, other))
    key = "base_model.model.model.layers.0.mlp.experts.lora_A.weight"
    assert torch.equal(first[key], second[key])  # every rank builds the same adapter
    assert not torch.equal(first[key], third[key])


def test_adapter_weights_are_found_inside_checkpoint_wrappers(model_args):
    # FSDP activation checkpointing wraps each decoder layer; peft 0.21.2 alone then saves nothing.
    model = apply_lora(tiny_gpt_oss(), build_lora_config(model_args), seed=0)
    layers = model.base_model.model.model.layers
    for index in range(len(layers)):
        layers[index] = checkpoint_wrapper(layers[index])
    saved = get_peft_model_state_dict(model)
    assert len(saved) == 24
    assert "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight" in saved
    assert not any("_checkpoint_wrapped_module" in key for key in saved)


def test_gptoss_recipe_is_the_seed(monkeypatch):
    for name in ("UC_CATALOG", "UC_SCHEMA", "UC_VOLUME", "UC_MODEL_NAME"):
        monkeypatch.delenv(name, raising=False)
    path = REPO_ROOT / "recipes" / "gptoss120b.yaml"
    recipe = load_recipe(path, {"use_cpu": True})
    m, d, t = recipe.model, recipe.data, recipe.training
    assert (m.model_name_or_path, m.dtype, m.attn_implementation, m.dequantize_mxfp4) == (
        "openai/gpt-oss-120b", "bfloat16", "eager", True)
    assert (m.use_peft, m.lora_r, m.lora_alpha, m.lora_dropout, m.lora_target_modules) == (True, 32, 32, 0.0, "all-linear")
    assert m.lora_target_parameters == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert m.lora_rank_pattern == {"mlp.experts.gate_up_proj": 8, "mlp.experts.down_proj": 8}
    assert (d.dataset_name, d.dataset_format, t.max_length) == ("HuggingFaceH4/Multilingual-Thinking", "reasoning", 2048)
    assert (t.per_device_train_batch_size, t.global_batch_size, t.learning_rate) == (1, 32, 1.5e-4)
    assert (t.lr_scheduler_type.value, t.warmup_steps, t.num_train_epochs, t.logging_steps) == ("cosine", 0.03, 1, 5)
    assert t.bf16 and t.activation_checkpointing is False
    assert t.output_dir == "/Volumes/main/default/checkpoints/gpt-oss-120b-peft"
    monkeypatch.setenv("UC_CATALOG", "prod")
    monkeypatch.setenv("UC_MODEL_NAME", "oss-run-7")
    assert load_recipe(path, {"use_cpu": True}).training.output_dir == "/Volumes/prod/default/checkpoints/oss-run-7"
    header = path.read_text().split("\n\n")[0]
    assert "--config_file accelerate_configs/fsdp2_8gpu.yaml scripts/sft.py recipes/gptoss120b.yaml" in header
    assert "scripts/launch_multinode.sh accelerate_configs/fsdp2_2node.yaml recipes/gptoss120b.yaml" in header
