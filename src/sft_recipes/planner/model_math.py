"""Model arithmetic from a config alone: the meta-device model, exact parameter counts, FLOPs per
token, and the accelerators' peaks.

Used by the rest of the planner (this package), the live metrics (`metrics.py`) and the linter:
`flops_per_token` is the one function every FLOP and MFU figure of the project uses. Everything runs
on the CPU in seconds without weights (the model is built on the meta device; LoRA applied by peft,
on meta too).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig, PreTrainedModel

from sft_recipes.architectures.towers import freeze_vision_tower
from sft_recipes.loading import model_class_for

if TYPE_CHECKING:
    from peft import LoraConfig

@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_gib: float  # what torch.cuda.get_device_properties(...).total_memory reports
    peak_bf16_flops: float  # dense, no sparsity


GPUS: tuple[GpuSpec, ...] = (
    GpuSpec("H100", 79.6, 989e12),  # 81559 MiB
    GpuSpec("H200", 140.4, 989e12),  # 143771 MiB
    GpuSpec("B200", 179.1, 2.25e15),  # 183359 MiB
    GpuSpec("B300", 268.0, 2.25e15),  # 288 GB decimal; torch reports ~268 GiB
)
GPU_BY_NAME = {gpu.name: gpu for gpu in GPUS}


def build_meta_model(config: PretrainedConfig) -> torch.nn.Module:
    """The full model, of the class training loads (`model_class_for`), on the meta device: exact
    shapes, no memory, no weights."""
    model_class = model_class_for(config)
    with torch.device("meta"):
        if issubclass(model_class, PreTrainedModel):
            return model_class._from_config(config)
        return model_class.from_config(config)


# --------------------------------------------------------------------------------------------
# Parameter counts


@dataclass(frozen=True)
class ParamCounts:
    """Exact counts from the meta model. FSDP units are the instances of the model's
    ``_no_split_modules`` classes (decoder layers, vision blocks); the root holds the rest."""

    total: int
    trainable: int
    embedding: int  # input embedding table
    output_head: int  # LM head weight; 0 when tied to the embedding
    flop_params: int  # parameters in a matmul per token: text decoder layers (MoE: active share) + LM head
    decoder_layers: tuple[int, ...]  # parameters of each text decoder layer
    largest_unit: int  # parameters of the largest FSDP unit
    largest_unit_trainable: int  # trainable parameters of the unit with the most of them
    root: int  # parameters outside every FSDP unit (FSDP2 root)
    root_trainable: int
    output_head_trainable: bool
    lora_ranks: dict[str, list[int]] = field(default_factory=dict)  # applied ranks by target, layer index as *
    lora_targeted_per_layer: int = 0  # largest per-layer sum of parameters targeted by target_parameters

    @property
    def frozen(self) -> int:
        return self.total - self.trainable


def text_config_of(config: PretrainedConfig) -> PretrainedConfig:
    return config.get_text_config()


def num_experts(text_config: PretrainedConfig) -> int:
    return getattr(text_config, "num_local_experts", None) or getattr(text_config, "num_experts", None) or 0


def _is_expert_parameter(name: str) -> bool:
    # gpt_oss "mlp.experts.gate_up_proj", mixtral "experts.0.w1.weight"; not "shared_experts"
    return ".experts." in f".{name}."


def _active_layer_params(layer: torch.nn.Module, text_config: PretrainedConfig) -> float:
    """Parameters one token passes through in this layer: each routed expert is used by top_k of E."""
    experts = num_experts(text_config)
    expert_share = text_config.num_experts_per_tok / experts if experts else 1.0
    return sum(p.numel() * (expert_share if _is_expert_parameter(n) else 1.0) for n, p in layer.named_parameters())


def _fsdp_units(model: torch.nn.Module, no_split: set[str]) -> list[torch.nn.Module]:
    """Outermost instances of the no-split classes: the modules FSDP2 wraps one by one."""
    units: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if type(module).__name__ in no_split:
            units.append(module)
            inside.update(id(sub) for sub in module.modules())
    return units


def _applied_lora(model: torch.nn.Module) -> tuple[dict[str, list[int]], int]:
    """Ranks peft really applied (by target, layer index as *) and the largest per-layer sum of
    parameters targeted through ``target_parameters``."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    ranks: dict[str, set[int]] = {}
    targeted_by_layer: dict[str, int] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        target = name.replace(".base_layer", "")
        if isinstance(module, ParamWrapper):
            target = f"{target}.{module.parameter_name}"
            layer = re.match(r"(.*?\.\d+)\.", target)
            key = layer.group(1) if layer else target
            targeted_by_layer[key] = targeted_by_layer.get(key, 0) + module.get_param().numel()
        target = re.sub(r"^base_model\.model\.", "", re.sub(r"\.\d+\.", ".*.", target))
        ranks.setdefault(target, set()).update(module.r.values())
    return {t: sorted(r) for t, r in sorted(ranks.items())}, max(targeted_by_layer.values(), default=0)


def _apply_lora(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    from peft import get_peft_model

    with warnings.catch_warnings():
        # peft 0.21 warns that rank_pattern keys for target_parameters "did not match" even when it
        # applies them; the applied ranks are read back from the modules and reported instead.
        warnings.filterwarnings("ignore", message=r".*rank_pattern keys did not match.*")
        with torch.device("meta"):
            return get_peft_model(model, lora)


def count_parameters(config: PretrainedConfig, lora: LoraConfig | None = None) -> ParamCounts:
    """Exact parameter counts of ``config``'s model built on the meta device, with ``lora`` (a
    ``peft.LoraConfig``) applied when given. Seconds even for a 120B MoE."""
    model = build_meta_model(config)
    freeze_vision_tower(model)  # as scripts/sft.py does: text-only SFT never trains a VLM's vision tower
    text_config = text_config_of(config)
    decoder = model.get_decoder()
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    tied = head is embedding
    decoder_layers = tuple(sum(p.numel() for p in layer.parameters()) for layer in decoder.layers)
    flop_params = round(sum(_active_layer_params(layer, text_config) for layer in decoder.layers)) + head.numel()
    no_split = set(model._no_split_modules or [])

    if lora is not None:
        model = _apply_lora(model, lora)
        lora_ranks, lora_targeted = _applied_lora(model)
    else:
        lora_ranks, lora_targeted = {}, 0

    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    units = _fsdp_units(model, no_split)
    unit_sizes = [sum(p.numel() for p in unit.parameters()) for unit in units]
    unit_trainable = [sum(p.numel() for p in unit.parameters() if p.requires_grad) for unit in units]
    return ParamCounts(
        total=total,
        trainable=trainable,
        embedding=embedding.numel(),
        output_head=0 if tied else head.numel(),
        flop_params=flop_params,
        decoder_layers=decoder_layers,
        largest_unit=max(unit_sizes, default=0),
        largest_unit_trainable=max(unit_trainable, default=0),
        root=total - sum(unit_sizes),
        root_trainable=trainable - sum(unit_trainable),
        output_head_trainable=head.requires_grad,
        lora_ranks=lora_ranks,
        lora_targeted_per_layer=lora_targeted,
    )


# --------------------------------------------------------------------------------------------
# FLOPs


def layer_types(text_config: PretrainedConfig) -> list[str]:
    return list(getattr(text_config, "layer_types", None) or ["full_attention"] * text_config.num_hidden_layers)


def head_dim(text_config: PretrainedConfig) -> int:
    return getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads


def _mean_attended_keys(seq_len: float, window: int | None) -> float:
    """Keys a query attends on average in a causal row of ``seq_len`` tokens (sliding: ``window``)."""
    if window is None or window >= seq_len:
        return (seq_len + 1) / 2
    return window - window * (window - 1) / (2 * seq_len)


def attention_flops_per_token(config: PretrainedConfig, seq_len: float) -> float:
    """Forward + backward FLOPs of the softmax-attention score and value products for one token.

    Per layer: 12 x (heads x head_dim) x mean keys attended (QK^T and AV, 2 FLOPs per multiply-add,
    x3 for forward + backward). Causal: a query attends (S + 1) / 2 keys on average, so this is
    the "12 L h S" term halved; sliding-window layers attend at most ``sliding_window``. Linear
    (gated-delta) layers have no quadratic term; their projections are in the 6N part.
    For packed rows pass ``seq_len = sum(L_i^2) / sum(L_i)`` over the documents.
    """
    text_config = text_config_of(config)
    q_width = text_config.num_attention_heads * head_dim(text_config)
    window = getattr(text_config, "sliding_window", None)
    flops = 0.0
    for layer_type in layer_types(text_config):
        if layer_type == "full_attention":
            flops += 12 * q_width * _mean_attended_keys(seq_len, None)
        elif layer_type == "sliding_attention":
            flops += 12 * q_width * _mean_attended_keys(seq_len, window)
    return flops


def flops_per_token(config: PretrainedConfig, counts: ParamCounts, seq_len: float) -> float:
    """Model FLOPs to train on one token (forward + backward), the numerator of every MFU.

    Full fine-tuning: 6N. LoRA (frozen base): 4N (forward 2N + activation gradients 2N, no weight
    gradients) + 6 x trainable. N counts parameters in a per-token matmul: the text decoder layers,
    MoE experts at their active share top_k / E, and the LM head; not the embedding lookup, not a
    vision tower that text-only SFT never runs. Plus `attention_flops_per_token`. Recomputation
    under activation checkpointing is not model work: an MFU figure absorbs it.
    """
    per_param = 4 if counts.lora_ranks else 6
    lora = 6 * counts.trainable if counts.lora_ranks else 0
    return per_param * counts.flop_params + lora + attention_flops_per_token(config, seq_len)
