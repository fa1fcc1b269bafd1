"""The model a run trains: loaded, a VLM's vision tower frozen, packing fixes, LoRA, FSDP2 guards."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sft_recipes.architectures import check_packing_leak, freeze_vision_tower, prepare_for_packing
from sft_recipes.architectures.preflight import check_image_packing_leak
from sft_recipes.architectures.qwen3_5 import prepare_for_image_packing
from sft_recipes.architectures.sequence_parallel import enable_sequence_parallel
from sft_recipes.compile import compile_decoder_layers
from sft_recipes.distributed import fsdp_requested
from sft_recipes.fp8 import convert_to_fp8_training, describe_fp8
from sft_recipes.fsdp_wrap import group_output_head_with_final_norm, guard_lora_fsdp_layout, pin_fsdp_wrap_classes
from sft_recipes.lora import apply_lora, build_lora_config, describe_lora
from sft_recipes.run.setup import Run

logger = logging.getLogger("sft")


@dataclass
class RunModel:
    model: torch.nn.Module
    lora_config: object | None  # the peft LoraConfig applied, built once; None for full fine-tuning
    wrap_classes: list[str]  # the FSDP2 unit classes, from the model itself
    compiled_layers: int = 0  # `torch_compile`: the FSDP2 units compiled in place (0: eager)


def build_model(run: Run) -> RunModel:
    model_args, training = run.recipe.model, run.recipe.training
    # What build_model does is logged once, by the main process: every rank does the same
    log = logger.info if run.is_main else lambda *args: None
    if run.packs_blocks:  # seconds on a tiny copy: refuse an architecture that would leak
        log("%s", check_packing_leak(run.source.config, model_args.attn_implementation))
        if run.has_images:
            log("%s", check_image_packing_leak(run.source.config))
    model = run.source.load_model()
    if not run.has_images:
        if frozen := freeze_vision_tower(model):  # text-only SFT of a VLM checkpoint: kept, exported, not trained
            log("vision tower frozen (%s parameters): text-only data never updates it", f"{frozen:,}")
    elif model_args.freeze_vision_tower:
        frozen = freeze_vision_tower(model, keep_merger=model_args.train_vision_merger)
        log("vision tower frozen (%s parameters)%s", f"{frozen:,}",
            ", merger trained" if model_args.train_vision_merger else "")
    if run.sequence_parallel is not None:  # before FSDP wraps it; prepares it for packing too
        enable_sequence_parallel(model, run.sequence_parallel.group)
    elif run.packs_blocks:
        prepare_for_packing(model)
        if run.has_images:
            prepare_for_image_packing(model)
    wrap_classes = pin_fsdp_wrap_classes(model, training.fsdp_wrap_classes)  # from the model, not guesses
    group_output_head_with_final_norm()  # else a VLM's lm_head is a unit TRL's fused head never gathers
    lora_config = build_lora_config(model_args) if model_args.use_peft else None
    if lora_config is not None:
        model = apply_lora(model, lora_config, seed=training.seed)
        log("%s", describe_lora(model))  # the ranks really applied
        guard_lora_fsdp_layout(model, wrap_classes)  # at the first step: LoRA sharded with its decoder layer
    if training.fp8:  # before compile (traced as float8) and fully_shard, as torchtitan orders them
        fsdp = fsdp_requested()
        log("%s", describe_fp8(convert_to_fp8_training(model, fsdp=fsdp), fsdp))
    # After LoRA (traced with its layers), before accelerate's activation checkpointing and fully_shard
    compiled = compile_decoder_layers(model, wrap_classes) if run.compiles_layers else 0
    return RunModel(model=model, lora_config=lora_config, wrap_classes=wrap_classes, compiled_layers=compiled)
