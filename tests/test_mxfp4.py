"""MXFP4 on CPU: a tiny hand-built gpt-oss checkpoint in the Hub format, loaded dequantized and merged.

The format (openai/gpt-oss-*): each expert projection is stored as `<name>_blocks` (uint8, two FP4
E2M1 codes per byte, low nibble first, 32 values per block along the input dimension) and
`<name>_scales` (uint8 exponent per block, bias 127), rows = output features:
gate_up_proj_blocks [E, 2*inter, hidden/32, 16], down_proj_blocks [E, hidden, inter/32, 16];
the model holds them dense and transposed, [E, in, out].
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from conftest import REPO_ROOT
from sft_recipes.config import load_recipe
from sft_recipes.lora import apply_lora, build_lora_config
from sft_recipes.merge import merge_checkpoint
from sft_recipes.loading import load_model, mxfp4_loading
from sft_recipes.tiny import ensure_tiny

TWIN = REPO_ROOT / "recipes" / "tiny" / "gptoss120b.yaml"
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
EXPERTS, HIDDEN, INTER = 4, 64, 128
PROJECTIONS = {"gate_up_proj": (2 * INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}  # (rows = out, in)


def encode(codes: torch.Tensor) -> torch.Tensor:
    """FP4 codes [E, out, in] -> blocks [E, out, in/32, 16]: byte k of a block = code 2k | code 2k+1 << 4."""
    pairs = codes.reshape(*codes.shape[:2], codes.shape[2] // 32, 16, 2).to(torch.uint8)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The known dense weight [E, in, out]: E2M1 value x 2^(scale - 127), scale per 32 inputs."""
    values = torch.tensor(E2M1)[codes.long()]
    exponents = scales.long().repeat_interleave(32, dim=-1) - 127
    return (values * torch.pow(2.0, exponents.float())).transpose(1, 2)


def write_mxfp4_checkpoint(out: Path) -> dict[str, torch.Tensor]:
    """The tiny gpt-oss with MXFP4 experts (+ its tokenizer) in `out`; returns the known dense expert weights."""
    source = Path(ensure_tiny("gpt_oss"))
    tensors = load_file(source / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    known = {}
    for layer in range(2):
        for projection, (rows, cols) in PROJECTIONS.items():
            name = f"model.layers.{layer}.mlp.experts.{projection}"
            codes = torch.randint(0, 16, (EXPERTS, rows, cols), generator=generator)
            scales = torch.randint(122, 128, (EXPERTS, rows, cols // 32), generator=generator, dtype=torch.uint8)
            if name == "model.layers.0.mlp.experts.gate_up_proj":  # a hand-made corner to read by eye
                codes[0, 0, 0:4] = torch.tensor([2, 7, 9, 15])  # bytes 0x72, 0xF9
                scales[0, 0, 0] = 129
            del tensors[name]
            tensors[f"{name}_blocks"] = encode(codes)
            tensors[f"{name}_scales"] = scales
            known[name] = decode(codes, scales)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy2(source / name, out)
    return known


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("mxfp4")
    return out, write_mxfp4_checkpoint(out)


def twin_args(path, **overrides):
    return load_recipe(TWIN, {"model_name_or_path": str(path), **overrides}).model


def test_hand_made_block_decodes_as_written(mxfp4_checkpoint):
    _, known = mxfp4_checkpoint
    corner = known["model.layers.0.mlp.experts.gate_up_proj"][0, 0:4, 0]  # expert 0, inputs 0-3, output 0
    assert corner.tolist() == [1.0 * 4, 6.0 * 4, -0.5 * 4, -6.0 * 4]  # codes 2, 7, 9, 15 at scale 2^(129-127)


def test_dequantizing_load_gives_the_known_bf16_weights(mxfp4_checkpoint):
    path, known = mxfp4_checkpoint
    model = load_model(twin_args(path, dtype="bfloat16"), str(path))
    state = model.state_dict()
    for name, weight in known.items():
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name].float(), weight), name  # E2M1 x 2^k is exact in bf16
    plain = load_file(f"{ensure_tiny('gpt_oss')}/model.safetensors")
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(state[q_proj], plain[q_proj].bfloat16())  # not an expert: loaded as it was
    assert torch.isfinite(model(input_ids=torch.tensor([[3, 14, 15, 92]])).logits).all()


def test_mxfp4_checkpoint_needs_the_dequantize_setting(mxfp4_checkpoint):
    path, _ = mxfp4_checkpoint
    with pytest.raises(ValueError, match="MXFP4-quantized checkpoint.*`dequantize_mxfp4: true`"):
        load_model(twin_args(path, dequantize_mxfp4=False), str(path))


def test_dequantize_setting_leaves_a_plain_checkpoint_alone():
    path = ensure_tiny("gpt_oss")
    assert mxfp4_loading(AutoModelForCausalLM.from_pretrained(path).config, True, path) is None


def test_merge_through_mxfp4_shards_equals_peft_on_the_dequantized_model(mxfp4_checkpoint, tmp_path):
    path, known = mxfp4_checkpoint
    dequantized = load_model(twin_args(path, dtype="float32"), str(path))
    peft_model = apply_lora(dequantized, build_lora_config(twin_args(path)), seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # as if trained: lora_B is no longer zero
        for param in (p for p in peft_model.parameters() if p.requires_grad):
            param.normal_(0.0, 0.05, generator=generator)
    peft_model.save_pretrained(tmp_path / "adapter")

    merge_checkpoint(path, tmp_path / "adapter", tmp_path / "merged", torch.float32)
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert not any(key.endswith(("_blocks", "_scales")) for key in merged)
    reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    for name in known:
        assert torch.allclose(merged[name], reference[name], atol=1e-6), name
        assert not torch.allclose(merged[name], known[name])  # the expert update is in
