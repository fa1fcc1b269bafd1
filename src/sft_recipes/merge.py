"""Merge a LoRA adapter into its base checkpoint, one safetensors shard at a time.

`merge_and_unload` needs the whole base model in memory, then a second copy to save it: 2 x 234 GB
for gpt-oss-120b. Here each base shard is read, merged and written before the next one is opened
(MXFP4 expert blocks are dequantized on the way), so memory holds about one shard.

Where each LoRA update goes, and its scaling, is read from peft itself: the adapter is applied to
an empty (meta) copy of the base, and each LoRA layer reports its target and layout. The update
itself is computed here, per tensor:

- Linear weight [out, in]:                 W + s * B @ A
- expert stack (peft ParamWrapper, E experts, rank r): lora_A is [E*r, in] with expert e's rows at
  e*r..e*r+r-1; lora_B is [out, r*E] with expert e's columns at j*E + e (j < r). The update of
  expert e is B_e @ A_e, [out, in]; gpt-oss stores experts as [E, in, out] (`is_transposed`), so
  it is added transposed there: gate_up_proj [E, hidden, 2*inter], down_proj [E, inter, hidden].
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig

from sft_recipes.lora import (
    ADAPTER_NAME,
    base_parameter_path,
    see_through_checkpoint_wrappers,
    without_false_pattern_warning,
)

SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_SHARD = "model.safetensors"
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
# Files a merged checkpoint takes over unchanged (tokenizer files come from the adapter dir first).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass(frozen=True)
class LoraUpdate:
    """Where one LoRA update goes in the base checkpoint, and how."""

    target: str  # base parameter name, e.g. "model.layers.0.mlp.experts.gate_up_proj"
    a_key: str  # keys in adapter_model.safetensors
    b_key: str
    scaling: float  # alpha / r (alpha / sqrt(r) with rsLoRA), as peft computed it
    num_experts: int  # 1 for a Linear weight
    experts_in_out: bool  # expert stack stored [E, in, out] (gpt-oss) rather than [E, out, in]


@dataclass(frozen=True)
class MergeReport:
    merged: int  # parameters that received a LoRA update
    expert_stacks: int  # of which expert stacks
    shards: int


def lora_updates(base_dir: str | Path, adapter_dir: str | Path) -> dict[str, LoraUpdate]:
    """Every LoRA update of the adapter, keyed by base parameter name (peft on a meta copy of the base)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer, ParamWrapper

    from sft_recipes.loading import model_class_for

    config = AutoConfig.from_pretrained(base_dir)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the meta copy only needs the dense layout the adapter was trained on
    with torch.device("meta"):
        skeleton = model_class_for(config)._from_config(config)
    see_through_checkpoint_wrappers()
    lora_config = LoraConfig.from_pretrained(str(adapter_dir))
    lora_config.inference_mode = True
    with without_false_pattern_warning():
        peft_skeleton = get_peft_model(skeleton, lora_config, adapter_name=ADAPTER_NAME)

    updates = {}
    for name, module in peft_skeleton.named_modules():
        if not isinstance(module, LoraLayer) or ADAPTER_NAME not in module.lora_A:
            continue
        if isinstance(module, ParamWrapper):
            target = base_parameter_path(f"{name}.{module.parameter_name}")
            num_experts = module.num_experts
            experts_in_out = bool(getattr(module.get_base_layer(), "is_transposed", False))
        else:
            if module.fan_in_fan_out or module.use_dora.get(ADAPTER_NAME) or type(module).__name__ != "Linear":
                raise ValueError(f"merge_lora merges LoRA on Linear weights and expert parameters; {name} is not one.")
            target, num_experts, experts_in_out = base_parameter_path(name) + ".weight", 1, False
        updates[target] = LoraUpdate(
            target=target,
            a_key=f"{name}.lora_A.weight",
            b_key=f"{name}.lora_B.weight",
            scaling=float(module.scaling[ADAPTER_NAME]),
            num_experts=num_experts,
            experts_in_out=experts_in_out,
        )
    return updates


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, update: LoraUpdate,
                  dtype: torch.dtype) -> torch.Tensor:
    """`weight` + its LoRA update, added in fp32, returned in `dtype`. Experts one at a time (small peak)."""
    if update.num_experts == 1:
        _check_fits(update, (lora_b.shape[0], lora_a.shape[1]), weight.shape)
        return (weight.float() + update.scaling * (lora_b.float() @ lora_a.float())).to(dtype)
    experts = update.num_experts
    per_expert = (lora_a.shape[1], lora_b.shape[0]) if update.experts_in_out else (lora_b.shape[0], lora_a.shape[1])
    _check_fits(update, (experts, *per_expert), weight.shape)
    a_per_expert = lora_a.float().reshape(experts, -1, lora_a.shape[-1])  # [E, r, in]
    b_per_expert = lora_b.float().reshape(lora_b.shape[0], -1, experts)  # [out, r, E]
    merged = torch.empty(weight.shape, dtype=dtype)
    for expert in range(experts):
        delta = update.scaling * (b_per_expert[:, :, expert] @ a_per_expert[expert])  # [out, in]
        merged[expert] = (weight[expert].float() + (delta.T if update.experts_in_out else delta)).to(dtype)
    return merged


def _check_fits(update: LoraUpdate, update_shape: tuple[int, ...], weight_shape: torch.Size) -> None:
    if tuple(update_shape) != tuple(weight_shape):
        raise ValueError(
            f"The LoRA update of {update.target} has shape {list(update_shape)} but the base weight is "
            f"{list(weight_shape)}: the adapter was trained on another model. Pass its base with --base."
        )


def merge_checkpoint(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path,
                     dtype: torch.dtype = torch.bfloat16) -> MergeReport:
    """Write base + adapter as a plain `dtype` checkpoint to `out_dir` (config, shards, index, tokenizer)."""
    base_dir, adapter_dir, out_dir = Path(base_dir), Path(adapter_dir), Path(out_dir)
    updates = lora_updates(base_dir, adapter_dir)
    shard_of = _shard_map(base_dir)
    shards = sorted(set(shard_of.values()))
    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map, applied, total_size = {}, set(), 0
    with safe_open(adapter_dir / "adapter_model.safetensors", framework="pt") as adapter:
        for shard in shards:
            merged = {}
            for name, tensor in _dense_tensors(base_dir, shard, shard_of):
                update = updates.get(name)
                if update is not None:
                    tensor = merged_weight(tensor, adapter.get_tensor(update.a_key), adapter.get_tensor(update.b_key),
                                           update, dtype)
                    applied.add(name)
                elif tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                merged[name] = tensor.contiguous()
            out_name = shard if len(shards) > 1 else SINGLE_SHARD
            save_file(merged, out_dir / out_name, metadata={"format": "pt"})
            total_size += sum(t.numel() * t.element_size() for t in merged.values())
            weight_map.update(dict.fromkeys(merged, out_name))
            del merged
    missing = sorted(set(updates) - applied)
    if missing:
        raise ValueError(
            f"{len(missing)} LoRA target(s) are not in the base checkpoint {base_dir}, e.g. {missing[:3]}: the adapter "
            "was trained on another model. Pass the base it was trained from with --base."
        )
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (out_dir / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
    _write_config(base_dir, out_dir, dtype)
    _copy_side_files(base_dir, adapter_dir, out_dir)
    experts = sum(1 for update in updates.values() if update.num_experts > 1)
    return MergeReport(merged=len(applied), expert_stacks=experts, shards=len(shards))


def _shard_map(base_dir: Path) -> dict[str, str]:
    """Checkpoint key -> shard file name."""
    index = base_dir / SAFETENSORS_INDEX
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    if (base_dir / SINGLE_SHARD).is_file():
        with safe_open(base_dir / SINGLE_SHARD, framework="pt") as single:
            return dict.fromkeys(single.keys(), SINGLE_SHARD)
    raise ValueError(f"{base_dir} has no {SAFETENSORS_INDEX} or {SINGLE_SHARD}: merge_lora needs a safetensors checkpoint.")


def _dense_tensors(base_dir: Path, shard: str, shard_of: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one shard under their model names; MXFP4 blocks+scales come out dequantized (bf16)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    with safe_open(base_dir / shard, framework="pt") as file:
        for key in file.keys():
            if key.endswith(MXFP4_SCALES) and key.removesuffix(MXFP4_SCALES) + MXFP4_BLOCKS in shard_of:
                continue  # consumed with its blocks
            if key.endswith(MXFP4_BLOCKS):
                name = key.removesuffix(MXFP4_BLOCKS)
                scales = _read_tensor(base_dir, shard_of, name + MXFP4_SCALES)
                yield name, convert_moe_packed_tensors(file.get_tensor(key), scales, dtype=torch.bfloat16)
            else:
                yield key, file.get_tensor(key)


def _read_tensor(base_dir: Path, shard_of: dict[str, str], key: str) -> torch.Tensor:
    if key not in shard_of:
        raise ValueError(f"{base_dir}: {key[: -len(MXFP4_SCALES)]}{MXFP4_BLOCKS} has no {key} beside it.")
    with safe_open(base_dir / shard_of[key], framework="pt") as file:
        return file.get_tensor(key)


def _write_config(base_dir: Path, out_dir: Path, dtype: torch.dtype) -> None:
    config = AutoConfig.from_pretrained(base_dir)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the merged experts are dense
    config.dtype = dtype
    config.save_pretrained(out_dir)


def _copy_side_files(base_dir: Path, adapter_dir: Path, out_dir: Path) -> None:
    if (base_dir / "generation_config.json").is_file():
        shutil.copy2(base_dir / "generation_config.json", out_dir)
    for name in TOKENIZER_FILES:
        source = adapter_dir / name if (adapter_dir / name).is_file() else base_dir / name
        if source.is_file():
            shutil.copy2(source, out_dir)


@dataclass(frozen=True)
class LogitCheck:
    """The merged model against base + adapter on the same probe tokens (per token: max |logit diff|)."""

    max_diff: float  # worst token, merged vs base + adapter
    median_diff: float
    tokens_beyond: int  # tokens whose difference exceeds the tolerance
    tokens: int
    allowed_beyond: int  # bf16 rounding flips MoE routing on a few near-tied tokens; fp32 flips none
    tolerance: float
    adapter_effect: float  # median token difference base vs base + adapter: what the merge must reproduce

    @property
    def passed(self) -> bool:
        # Within tolerance, and much closer to base + adapter than the base is: a merge that dropped or
        # misplaced the updates lands near the base, and a tolerance alone would not see it in bf16.
        reproduces_adapter = self.adapter_effect <= self.tolerance or self.median_diff < 0.5 * self.adapter_effect
        return self.tokens_beyond <= self.allowed_beyond and reproduces_adapter

    def summary(self) -> str:
        return (f"max |logit diff| merged vs base+adapter {self.max_diff:.3g}, median per token {self.median_diff:.3g}, "
                f"{self.tokens_beyond} of {self.tokens} tokens beyond {self.tolerance:.3g} ({self.allowed_beyond} "
                f"allowed); the adapter moves the base's logits by {self.adapter_effect:.3g} (median per token)")


def probe_input_ids(vocab_size: int, batch: int = 4, length: int = 32, seed: int = 0) -> torch.Tensor:
    """Fixed pseudo-random token ids: they route through many experts, unlike a short real sentence."""
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def verify_merge(base_dir: str | Path, adapter_dir: str | Path, merged_dir: str | Path, dtype: torch.dtype,
                 device_map: str | None = None) -> LogitCheck:
    """Logits of the merged checkpoint (plain transformers) vs base + adapter (peft), one model in memory at a time.

    Both run in fp32 whatever `dtype` the merged weights are stored in: bf16 compute noise flips MoE
    routing on near-ties and swamps the comparison, while the only real difference is the rounding
    of the merged weights to `dtype`. Memory: 4 bytes per parameter, one model at a time.
    """
    import gc

    from sft_recipes.lora import load_adapter
    from sft_recipes.loading import model_class_for, mxfp4_loading

    config = AutoConfig.from_pretrained(base_dir)
    input_ids = probe_input_ids(config.get_text_config().vocab_size)
    base = model_class_for(config).from_pretrained(
        base_dir, dtype=torch.float32, device_map=device_map,
        quantization_config=mxfp4_loading(config, True, str(base_dir)),
    )
    adapted = load_adapter(base, adapter_dir).eval()
    reference = _logits(adapted, input_ids)
    with adapted.disable_adapter():
        base_logits = _logits(adapted, input_ids)
    del adapted, base
    gc.collect()
    merged_config = AutoConfig.from_pretrained(merged_dir)
    merged = model_class_for(merged_config).from_pretrained(merged_dir, dtype=torch.float32, device_map=device_map)
    merged.eval()
    merged_logits = _logits(merged, input_ids)
    exact = dtype == torch.float32
    rtol, atol = (1e-5, 1e-4) if exact else (2e-2, 1e-2)  # bf16 rounds each merged weight by up to 2^-9
    tolerance = atol + rtol * reference.abs().max().item()
    token_diffs = (merged_logits - reference).abs().amax(-1).flatten()
    return LogitCheck(
        max_diff=token_diffs.max().item(),
        median_diff=token_diffs.median().item(),
        tokens_beyond=int((token_diffs > tolerance).sum()),
        tokens=token_diffs.numel(),
        allowed_beyond=0 if exact else token_diffs.numel() // 20,
        tolerance=tolerance,
        adapter_effect=(base_logits - reference).abs().amax(-1).median().item(),
    )


def _logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids.to(model.device)).logits.float().cpu()
