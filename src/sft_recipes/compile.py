"""`torch_compile: true`: every decoder layer compiled in place before FSDP2 wraps it (torchtitan's per-block compile).

transformers hands its own `torch_compile` to accelerate, which compiles after activation checkpointing, at
prepare time: the whole model, or with regional compilation each repeated block AND every other leaf module
(embeddings, norms, rotary, head: `accelerate.utils.other.compile_regions_fsdp2`), each a compile of its own
-- ~30 s apiece on 2 CPU cores. We take the key over before the Trainer exists (accelerate's dynamo plugin
stays off) and compile only the FSDP2 unit classes (the decoder layers, a VLM's vision blocks), in place
(`module.compile()`: `fully_shard`'s hooks still run on `_call_impl`, unlike an `OptimizedModule`), after
LoRA so its layers are traced with them. accelerate then wraps each compiled layer in its activation
checkpoint (recompute calls the compiled layer again) and shards it.

Shapes: a packed block is always [B, max_length], whatever its examples' count and lengths (their bounds are
tensors), so a layer compiles once: measured 1 graph over 20 steps of changing blocks (`CompileReport` puts the
count in every step line; a test bounds it). Graph breaks and their causes: docs/compile.md.
"""

from __future__ import annotations

import logging

import torch
from transformers import TrainerCallback

logger = logging.getLogger("sft")


def take_over_torch_compile(training_args) -> bool:
    """Whether the recipe asks for `torch_compile`; switched off on the TrainingArguments (and its backend, which
    transformers set to inductor), so accelerate compiles nothing itself. Before the Trainer is built."""
    asked = bool(training_args.torch_compile)
    training_args.torch_compile, training_args.torch_compile_backend = False, None
    return asked


def compile_decoder_layers(model: torch.nn.Module, layer_classes: list[str], backend: str = "inductor") -> int:
    """Compile every module whose class is one of `layer_classes` in place; the number compiled. (`backend`: gpu-check's
    CPU dry run traces with dynamo's "eager" backend, as inductor takes ~30 s a layer on a small CPU.)"""
    # As accelerate's and torchtitan's per-block compile: gpt-oss's expert routing has data-dependent shapes
    # (.item()/nonzero), and a forward's Python side effects are not replayed when checkpointing recomputes it.
    torch._dynamo.config.capture_scalar_outputs = True
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    # A layer frame's compiled variants: 2 nested forward wrappers (transformers' checkpointing one, again on FSDP2's
    # subclass) x input requiring grad or not x static then dynamic lengths = 8, dynamo's default recompile_limit; past
    # it a frame runs eagerly, and checkpoint's recompute then saves other tensors than the compiled forward did
    # (CheckpointError, measured on the gpt-oss twin at step 2). The variants are bounded, not per layer or step.
    torch._dynamo.config.recompile_limit = 64
    layers = [module for module in model.modules() if type(module).__name__ in layer_classes]
    run_expert_lora_eagerly(model)
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)


def run_expert_lora_eagerly(model: torch.nn.Module) -> None:
    """Keep peft's `ParamWrapper`s (LoRA on parameters: gpt-oss's experts) out of the compiled graphs.

    Every forward, a ParamWrapper registers a torch parametrization on the experts module (a fresh class each call)
    and removes it after. Traced, that breaks the graph and fails dynamo's guards on every call until its
    recompile_limit (8), after which those frames run eagerly: under activation checkpointing the recompute then
    ran other graphs than the forward had, and backward raised CheckpointError (saved tensors in another order).
    Run eagerly, forward and recompute take the same path (measured: gradients equal eager's, docs/compile.md)."""
    from peft.tuners.lora.layer import ParamWrapper

    for module in model.modules():
        if isinstance(module, ParamWrapper):
            module.forward = torch.compiler.disable(module.forward)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far: one per layer class and shape family, plus recompiles
    and the pieces a graph break leaves."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompileReport(TrainerCallback):
    """Every training log carries `compiled_graphs` (the step line shows it): a count that grows every step means
    a recompile every step."""

    def __init__(self, layers: int, classes: list[str]) -> None:
        self.layers, self.classes = layers, classes

    def on_train_begin(self, args, state, control, **kwargs):
        if args.process_index == 0:
            logger.info("[compile] torch.compile on: %d layers (%s) compiled in place before FSDP2 wrapping",
                        self.layers, ", ".join(self.classes))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "loss" in logs:
            logs["compiled_graphs"] = compiled_graphs()
