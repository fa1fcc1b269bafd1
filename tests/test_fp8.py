"""`fp8: true` (sft_recipes.fp8): torchao float8 training of the text decoder layers' Linear layers.

Which layers are converted (never embeddings, LM head, vision tower or MoE router), the refusals (a GPU without
FP8 tensor cores, through a monkeypatched capability; LoRA), and one run of the Llama twin under the GPU
precision (fsdp2_cpu_bf16.yaml) in torchao's CPU emulation against the same run in bf16.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from conftest import REPO_ROOT, TINY_LLAMA_RECIPE, launch_sft, read_summary
from sft_recipes.config import RecipeError, load_recipe
from sft_recipes.fp8 import convert_to_fp8_training, fp8_linear_names
from sft_recipes.lint import LintContext, lint_recipe
from sft_recipes.tiny import ensure_tiny

STEPS = 4
COMMON = ("--max_steps", str(STEPS), "--save_steps", "1000", "--logging_steps", "1", "--report_to", "none",
          "--bf16", "true", "--export_dtype", "bfloat16")
# |fp8 - bf16| loss per step over the twin's first 4 steps: measured at most 0.0105 (docs/precision.md)
FP8_LOSS_TOLERANCE = 0.05
LLAMA_LAYER = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj"]


def test_only_the_decoder_layers_linear_layers_are_converted():
    llama = AutoModelForCausalLM.from_pretrained(ensure_tiny("llama"))
    expected = [f"model.layers.{layer}.{name}" for layer in (0, 1) for name in LLAMA_LAYER]
    assert fp8_linear_names(llama) == expected  # not model.embed_tokens, not lm_head
    assert convert_to_fp8_training(llama, fsdp=False) == sorted(expected)
    converted = {name for name, module in llama.named_modules() if type(module).__name__ == "Float8Linear"}
    assert converted == set(expected) and type(llama.lm_head).__name__ == "Linear"
    gpt_oss = AutoModelForCausalLM.from_pretrained(ensure_tiny("gpt_oss"))
    names = fp8_linear_names(gpt_oss)
    assert names and all(".self_attn." in name for name in names)  # experts are 3-D parameters, the router is no Linear
    assert not any("router" in name for name in names)
    qwen = AutoModelForCausalLM.from_pretrained(ensure_tiny("qwen3_5"))  # 3 gated-delta layers, then attention
    assert fp8_linear_names(qwen)[:6] == [  # the decay and beta gates (in_proj_a, in_proj_b) stay
        "model.layers.0.linear_attn.out_proj", "model.layers.0.linear_attn.in_proj_qkv",
        "model.layers.0.linear_attn.in_proj_z", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
        "model.layers.0.mlp.down_proj"]


@pytest.mark.parametrize("capability, refused", [((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)])
def test_a_gpu_without_fp8_tensor_cores_is_refused_in_one_line(tmp_path, monkeypatch, capability, refused):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    recipe = load_recipe(TINY_LLAMA_RECIPE, {"fp8": True, "output_dir": str(tmp_path)})
    if not refused:
        lint_recipe(recipe, LintContext(world_size=1, has_accelerator=True))
        return
    with pytest.raises(RecipeError) as error:
        lint_recipe(recipe, LintContext(world_size=1, has_accelerator=True))
    assert (f"fp8: true needs FP8 tensor cores (compute capability 8.9+: L4, L40S, H100, H200, B200), and this GPU "
            f"(NVIDIA Test GPU) is sm_{capability[0]}{capability[1]}: set fp8: false") in str(error.value)


def test_fp8_without_torchao_is_refused_with_the_install_command(tmp_path, monkeypatch):
    """requirements.txt (what `make setup` installs) has no torchao: `--fp8 true` there is this one line."""
    import sys

    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao.float8` raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    recipe = load_recipe(TINY_LLAMA_RECIPE, {"fp8": True, "output_dir": str(tmp_path)})
    with pytest.raises(RecipeError) as error:
        lint_recipe(recipe, LintContext(world_size=1, has_accelerator=False))
    assert ("fp8: true trains through torchao's float8 Linear layers, and torchao is not installed: install "
            "torchao==0.18.0 where the run trains (`.venv/bin/pip install torchao==0.18.0` in this clone; on AI Runtime, "
            "in the workload's dependencies), or set fp8: false") in str(error.value)
    pinned = (REPO_ROOT / "requirements-test.txt").read_text().splitlines()
    assert "torchao==0.18.0" in pinned  # the version the message names is the one the tests run


def test_fp8_with_lora_is_refused(tmp_path):
    recipe = load_recipe(REPO_ROOT / "recipes" / "tiny" / "gptoss120b.yaml", {"fp8": True, "output_dir": str(tmp_path)})
    with pytest.raises(RecipeError, match="fp8: true converts the decoder's Linear layers to float8 training, and "
                                          "LoRA freezes them"):
        lint_recipe(recipe, LintContext(world_size=1, has_accelerator=False))


@pytest.mark.fsdp
def test_emulated_fp8_trains_like_bf16_and_exports_in_bf16(tmp_path):
    config = REPO_ROOT / "accelerate_configs" / "fsdp2_cpu_bf16.yaml"
    launch_sft(TINY_LLAMA_RECIPE, *COMMON, "--output_dir", str(tmp_path / "bf16"), config=config)
    result = launch_sft(TINY_LLAMA_RECIPE, *COMMON, "--fp8", "true", "--output_dir", str(tmp_path / "fp8"), config=config)
    output = result.stdout + result.stderr
    assert output.count("[fp8] 14 Linear layers of the decoder train in float8 (torchao, emulated on CPU); embeddings, "
                        "LM head and routers stay in the compute dtype") == 1  # once: by the main process
    fp8, bf16 = read_summary(tmp_path / "fp8"), read_summary(tmp_path / "bf16")
    assert list(fp8["losses"]) == list(bf16["losses"]) == [str(step) for step in range(1, STEPS + 1)]
    worst = max(abs(fp8["losses"][step] - bf16["losses"][step]) for step in bf16["losses"])
    print(f"max |fp8 - bf16| loss {worst:.4g}; export logit diff {fp8['export_max_logit_diff']:.3g}")
    assert 0 < worst <= FP8_LOSS_TOLERANCE  # float8 rounding changes the losses, within the tolerance
    with safe_open(tmp_path / "fp8" / "model.safetensors", "pt") as f:
        assert {str(f.get_slice(name).get_dtype()) for name in f.keys()} == {"BF16"}
        assert "model.layers.0.self_attn.q_proj.weight" in set(f.keys())  # a plain Linear's name: loads anywhere
