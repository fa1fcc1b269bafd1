"""`fp8: true`: torchao float8 training of the text decoder layers' Linear layers (torchao 0.18.0).

Converted: every `nn.Linear` inside the text decoder's `layers` (attention and MLP projections) whose sizes
are multiples of 16 (what `torch._scaled_mm` takes). Left alone: the embeddings, the LM head, a VLM's vision
tower, and gates (`GATE_NAMES`: MoE routers, as torchtitan leaves them, and the gated delta rule's decay and
beta projections). Each converted layer runs its three matmuls in float8 with dynamic
tensorwise scales; its weight stays in the master dtype, so checkpoints, the optimizer and the export (in the
recipe's `export_dtype`) see plain tensors -- on CPU; with float8 all-gather (GPU) torchao wraps each weight in
its `WeightWithDynamicFloat8CastTensor`, whose checkpoints are not verified here.

Where it runs: a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell) runs real float8 matmuls;
an older GPU is refused by the linter (`fp8_problem`); on CPU torchao's emulation (`Float8LinearConfig(emulate=
True)`) casts to float8 and back and multiplies in high precision: the same rounding, no speed. Under FSDP2 on
a GPU the weights are all-gathered in float8 (`enable_fsdp_float8_all_gather`: half the bytes of bf16); on CPU
that stays off: gloo has no float8 collectives (`all_gather_into_tensor` of a float8 tensor raises "Invalid
scalar type").
"""

from __future__ import annotations

import torch

TORCHAO = "torchao==0.18.0"
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm_89), Hopper (sm_90), Blackwell
# Gates, not projections: an MoE router's Linear (`gate`, `shared_expert_gate`; gate_proj is a projection) and the
# gated delta rule's per-head decay and beta (`in_proj_a`, `in_proj_b`): one rounding flips a top-k or a decay.
GATE_NAMES = ("router", "gate", "shared_expert_gate", "in_proj_a", "in_proj_b")


def fp8_problem(use_peft: bool) -> str | None:
    """Why this machine cannot train with `fp8: true`, None when it can (a CPU emulates)."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return (f"fp8: true trains through torchao's float8 Linear layers, and torchao is not installed: install "
                f"{TORCHAO} where the run trains (`.venv/bin/pip install {TORCHAO}` in this clone; on AI Runtime, in "
                "the workload's dependencies), or set fp8: false")
    if use_peft:
        return ("fp8: true converts the decoder's Linear layers to float8 training, and LoRA freezes them (PEFT wraps "
                "them as base layers; not verified here): set fp8: false, or use_peft: false for full fine-tuning")
    if torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        if capability < MIN_CAPABILITY:
            return (f"fp8: true needs FP8 tensor cores (compute capability 8.9+: L4, L40S, H100, H200, B200), and this "
                    f"GPU ({torch.cuda.get_device_name()}) is sm_{capability[0]}{capability[1]}: set fp8: false "
                    "(bf16 trains on it)")
    return None


def fp8_linear_names(model: torch.nn.Module) -> list[str]:
    """The fully qualified names of the Linear layers `fp8: true` converts."""
    from sft_recipes.architectures.towers import text_decoder

    decoder = text_decoder(model)
    if decoder is None:
        return []
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    names = []
    for name, module in decoder.layers.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in GATE_NAMES \
                and module.in_features % 16 == 0 and module.out_features % 16 == 0:
            names.append(f"{prefix}.layers.{name}" if prefix else f"layers.{name}")
    return names


def convert_to_fp8_training(model: torch.nn.Module, fsdp: bool) -> list[str]:
    """Swap the decoder layers' Linear layers for torchao's Float8Linear, in place; their names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = set(fp8_linear_names(model))
    config = Float8LinearConfig(emulate=not torch.cuda.is_available(), enable_fsdp_float8_all_gather=_gathers_fp8(fsdp))
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn in names)
    return sorted(names)


def describe_fp8(converted: list[str], fsdp: bool) -> str:
    """The run's `[fp8]` line for the layers `convert_to_fp8_training` converted."""
    on_gpu = torch.cuda.is_available()
    return (f"[fp8] {len(converted)} Linear layers of the decoder train in float8 (torchao, "
            f"{'real float8 matmuls' if on_gpu else 'emulated on CPU'}"
            f"{', FSDP2 all-gathers their weights in float8' if _gathers_fp8(fsdp) else ''}); embeddings, LM head "
            "and routers stay in the compute dtype")


def _gathers_fp8(fsdp: bool) -> bool:
    return fsdp and torch.cuda.is_available()  # gloo has no float8 collectives (docs/precision.md)
