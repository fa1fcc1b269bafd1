"""Cross-file checks run before anything heavy loads: each rule names its fix; all problems at once.

A rule reads the recipe, the launcher's settings (world size, the accelerate config as exported
to the environment) and, when it needs one, the model's config.json; it returns a message or None.
`scripts/sft.py` runs every rule at start and in `--dry-run`. Checks of one dataclass alone (e.g.
lora_dropout with target_parameters) live in that dataclass's __post_init__ and surface the same way.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from sft_recipes.batching import derive_gradient_accumulation
from sft_recipes.config import Recipe, RecipeError
from sft_recipes.data.formats import CHAT_FORMATS
from sft_recipes.data.mixture import has_images, is_streamed
from sft_recipes.distributed import launch_flag, launched_world_size
from sft_recipes.fp8 import fp8_problem


@dataclass
class LintContext:
    world_size: int
    has_accelerator: bool
    model_config_loader: Callable[[], object] | None = None  # config.json of the recipe's model

    @cached_property
    def model_config(self):
        return self.model_config_loader() if self.model_config_loader else None

    @staticmethod
    def from_environment(model_config_loader=None, world_size: int | None = None) -> LintContext:
        return LintContext(
            world_size=world_size or launched_world_size(),
            has_accelerator=torch.cuda.is_available(),
            model_config_loader=model_config_loader,
        )


def activation_checkpointing_twice(recipe: Recipe, ctx: LintContext) -> str | None:
    if recipe.training.activation_checkpointing and launch_flag("FSDP_ACTIVATION_CHECKPOINTING"):
        return ("activation checkpointing is on twice: in the accelerate config (fsdp_activation_checkpointing) and in "
                "the recipe (activation_checkpointing/gradient_checkpointing, which TRL turns on by default); set "
                "`activation_checkpointing: false` in the recipe and keep FSDP's")
    return None


def trl_packing_with_block_packing(recipe: Recipe, ctx: LintContext) -> str | None:
    t = recipe.training
    if recipe.data.pack_blocks and (t.packing or t.padding_free):
        return ("pack_blocks packs with the project's block-diagonal collator, so TRL's own `packing`/`padding_free` must "
                "then be false (TRL refuses a custom collator with padding-free): set packing: false and "
                "padding_free: false, or pack_blocks: false")
    return None


def block_packing_needs_chat_data(recipe: Recipe, ctx: LintContext) -> str | None:
    if recipe.data.pack_blocks and recipe.data.dataset_format not in CHAT_FORMATS:
        return (f"pack_blocks needs a chat dataset_format, one of {CHAT_FORMATS} (got {recipe.data.dataset_format!r}): "
                "set pack_blocks: false, or " + ("dataset_format: alpaca_chat (the rows as chat conversations)"
                                                 if recipe.data.dataset_format == "alpaca" else
                                                 "give the data as chat conversations (dataset_format: messages)"))
    return None


def unpacked_stream_without_max_steps(recipe: Recipe, ctx: LintContext) -> str | None:
    data, training = recipe.data, recipe.training
    if is_streamed(data) and not data.pack_blocks and training.max_steps < 0:
        return ("max_steps: -1 trains num_train_epochs passes, and a stream read unpacked (TRL's pipeline) has no "
                "length to count them from (the Trainer would stop after loading the model): set max_steps to the "
                "steps to train, or pack_blocks: true with chat data (a packed stream's passes are counted before "
                "training)")
    return None


def streamed_rows_counted_in_a_worker(recipe: Recipe, ctx: LintContext) -> str | None:
    data, training = recipe.data, recipe.training
    if is_streamed(data) and not data.pack_blocks and training.dataloader_num_workers:
        return ("a streamed dataset read unpacked is checked in the process that reads it, and a dataloader "
                "worker's counts of dropped rows never reach max_dropped_share: set dataloader_num_workers: 0, or "
                "pack_blocks: true (chat data: each worker counts with the blocks it sends)")
    return None


def _packs(recipe: Recipe) -> bool:
    t = recipe.training
    return bool(recipe.data.pack_blocks or t.packing or t.padding_free)


def packing_architecture_needs_our_fixes(recipe: Recipe, ctx: LintContext) -> str | None:
    from sft_recipes.architectures import PACKING_QUIRKS

    t = recipe.training
    config = ctx.model_config if (t.packing or t.padding_free) else None
    if config is not None and config.model_type in PACKING_QUIRKS:
        return (f"TRL's packing/padding_free lets packed examples leak into each other on {config.model_type} "
                f"(attention {recipe.model.attn_implementation!r}); use `pack_blocks: true` with packing: false, "
                "which applies this project's fixes and checks them before training")
    return None


def hybrid_model_without_reference_kernels(recipe: Recipe, ctx: LintContext) -> str | None:
    from sft_recipes.architectures import PACKING_QUIRKS

    config = ctx.model_config if _packs(recipe) else None
    if config is None:
        return None
    layer_types = getattr(config.get_text_config(), "layer_types", None) or []
    if "linear_attention" in layer_types and config.model_type not in PACKING_QUIRKS:
        return (f"{config.model_type} has linear-attention layers and no segment-aware kernels or reference path here: "
                "packed examples would share convolution and recurrent state; turn packing off, or add the "
                "architecture to sft_recipes.architectures.registry.PACKING_QUIRKS")
    return None


def wrap_class_absent_from_model(recipe: Recipe, ctx: LintContext) -> str | None:
    wanted = recipe.training.fsdp_wrap_classes
    if not wanted or ctx.model_config is None:
        return None
    from sft_recipes.fsdp_wrap import resolve_fsdp_wrap_classes
    from sft_recipes.planner.model_math import build_meta_model

    try:  # the meta model has the real module tree, at no memory cost
        resolve_fsdp_wrap_classes(build_meta_model(ctx.model_config), wanted)
    except ValueError as err:
        return str(err).rstrip(".")
    return None


def cpu_offload_without_accelerator(recipe: Recipe, ctx: LintContext) -> str | None:
    if launch_flag("FSDP_OFFLOAD_PARAMS") and not ctx.has_accelerator:
        return "fsdp_offload_params needs an accelerator to offload from; set fsdp_offload_params: false on CPU"
    return None


def bf16_without_hardware_support(recipe: Recipe, ctx: LintContext) -> str | None:
    t = recipe.training
    # Only the machine that trains can tell; a dry run on a laptop plans for the cluster's GPUs.
    if t.bf16 and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return "bf16: true but this GPU has no bf16 (pre-Ampere); use fp16: true and bf16: false, or a newer GPU"
    return None


def mixed_precision_differs_from_launch(recipe: Recipe, ctx: LintContext) -> str | None:
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")  # `accelerate launch` exports the config's mixed_precision
    t = recipe.training
    asked = "fp16" if t.fp16 else "bf16" if t.bf16 else "no"
    if launched is None or launched.lower() == asked:
        return None
    # transformers takes the recipe's bf16/fp16 when set, else the launcher's value: one side is silently overruled.
    computes = asked if asked != "no" else launched.lower()
    example = {"no": " (accelerate_configs/fsdp2_cpu.yaml)",
               "bf16": " (on CPU accelerate_configs/fsdp2_cpu_bf16.yaml or hsdp_cpu_bf16.yaml, on GPUs the others)"
               }.get(asked, "")
    return (f"the accelerate config launches with mixed_precision: {launched} but the recipe says bf16: "
            f"{str(t.bf16).lower()}, fp16: {str(t.fp16).lower()}, so the run would silently compute in {computes} (and "
            f"an fp32 export check then fails); make them agree: launch with an accelerate config whose mixed_precision "
            f"is {asked!r}{example}, or change bf16/fp16 in the recipe")


def batch_the_world_cannot_produce(recipe: Recipe, ctx: LintContext) -> str | None:
    t = recipe.training
    if (t.global_batch_size or t.global_batch_tokens) and "gradient_accumulation_steps" in recipe.values:
        key = "global_batch_size" if t.global_batch_size else "global_batch_tokens"
        # The shipped recipes state their global batch so that SP, HSDP and node counts keep the experiment; a fixed
        # accumulation beside it would change the batch on another layout, silently, so it is refused.
        return (f"{key}: {getattr(t, key)} ({where_set(recipe, key)}) and gradient_accumulation_steps: "
                f"{t.gradient_accumulation_steps} ({where_set(recipe, 'gradient_accumulation_steps')}) are both set, "
                "and a fixed accumulation would change the global batch on another layout; drop "
                "gradient_accumulation_steps (it is derived from the global batch and the world size), or pass "
                "--global_batch_size N to train another global batch")
    if ctx.world_size % t.sequence_parallel_size:
        return None  # sequence_parallel_size_not_dividing_the_world says so
    try:
        derive_gradient_accumulation(t, ctx.world_size)
    except ValueError as err:
        return str(err).rstrip(".")
    return None


def where_set(recipe: Recipe, key: str) -> str:
    """Which source the key's value came from: the last override source that set it, else the recipe file."""
    sources = [source for source, values in recipe.overrides.items() if key in values]
    if not sources:
        return "recipe"
    return "HYPERPARAMETERS_PATH" if sources[-1] == "parameters" else sources[-1].replace("_", " ")


def _sequence_parallel(recipe: Recipe) -> bool:
    return recipe.training.sequence_parallel_size > 1


def sequence_parallel_with_trl_packing(recipe: Recipe, ctx: LintContext) -> str | None:
    t = recipe.training
    if _sequence_parallel(recipe) and (t.packing or t.padding_free):
        return ("sequence_parallel_size > 1 shards the project's packed blocks; TRL's own `packing`/`padding_free` "
                "must be false: set packing: false and padding_free: false, with `pack_blocks: true`")
    return None


def sequence_parallel_without_block_packing(recipe: Recipe, ctx: LintContext) -> str | None:
    if _sequence_parallel(recipe) and not recipe.data.pack_blocks:
        return ("sequence_parallel_size > 1 splits packed blocks across ranks and needs `pack_blocks: true` "
                "(or sequence_parallel_size: 1)")
    return None


def sequence_parallel_on_image_data(recipe: Recipe, ctx: LintContext) -> str | None:
    if _sequence_parallel(recipe) and has_images(recipe.data):
        return ("sequence parallelism does not shard image blocks yet (an image's tokens, pixels and mRoPE positions "
                "would be split across ranks); set sequence_parallel_size: 1 for image data")
    return None


def sequence_parallel_attention_implementation(recipe: Recipe, ctx: LintContext) -> str | None:
    from sft_recipes.architectures.sequence_parallel import SUPPORTED_IMPLEMENTATIONS

    implementation = recipe.model.attn_implementation or "sdpa"  # transformers' default
    if _sequence_parallel(recipe) and implementation not in SUPPORTED_IMPLEMENTATIONS:
        return (f"attn_implementation {implementation!r} cannot take the block's example boundaries under sequence "
                f"parallelism; use one of {SUPPORTED_IMPLEMENTATIONS}")
    return None


def sequence_parallel_size_not_dividing_the_world(recipe: Recipe, ctx: LintContext) -> str | None:
    sp = recipe.training.sequence_parallel_size
    if sp < 1 or ctx.world_size % sp:
        divisors = [n for n in range(1, ctx.world_size + 1) if ctx.world_size % n == 0]
        return f"sequence_parallel_size={sp} must divide the world size {ctx.world_size}; use one of {divisors}"
    return None


def block_length_not_divisible_by_sequence_parallel_size(recipe: Recipe, ctx: LintContext) -> str | None:
    sp, length = recipe.training.sequence_parallel_size, recipe.training.max_length
    if _sequence_parallel(recipe) and length is not None and length % sp:
        return (f"max_length={length} does not split into sequence_parallel_size={sp} equal chunks; use a multiple "
                f"of {sp}, e.g. {length - length % sp}")
    return None


def sequence_parallel_size_the_heads_cannot_take(recipe: Recipe, ctx: LintContext) -> str | None:
    from sft_recipes.architectures.sequence_parallel import check_sequence_parallel_size

    config = ctx.model_config if _sequence_parallel(recipe) else None
    if config is None:
        return None
    try:
        check_sequence_parallel_size(config.get_text_config(), recipe.training.sequence_parallel_size)
    except ValueError as err:
        return str(err).rstrip(".")
    return None


def sequence_parallel_without_global_token_count(recipe: Recipe, ctx: LintContext) -> str | None:
    if _sequence_parallel(recipe) and not recipe.training.average_tokens_across_devices:
        return ("sequence parallelism divides each rank's chunk loss by the step's supervised tokens over all ranks: "
                "leave average_tokens_across_devices at true")
    return None


def parallelism_config_these_recipes_cannot_run(recipe: Recipe, ctx: LintContext) -> str | None:
    from sft_recipes.hsdp import parallelism_problems

    return "; ".join(parallelism_problems(ctx.world_size, recipe.training.sequence_parallel_size)) or None


def activation_offloading_without_accelerator(recipe: Recipe, ctx: LintContext) -> str | None:
    # TRL's OffloadActivations asks torch.accelerator.current_accelerator().type, None on a CPU-only machine.
    if recipe.training.activation_offloading and not ctx.has_accelerator:
        return "activation_offloading moves activations from an accelerator to the host; set activation_offloading: false on CPU"
    return None


def torch_compile_settings_we_do_not_run(recipe: Recipe, ctx: LintContext) -> str | None:
    # transformers turns torch_compile on for either key and hands both to accelerate's whole-model compile;
    # sft_recipes.compile compiles each decoder layer with inductor's default mode instead, and would drop them.
    set_keys = [key for key in ("torch_compile_backend", "torch_compile_mode")
                if recipe.values.get(key) not in (None, "inductor" if key == "torch_compile_backend" else None)]
    if not set_keys:
        return None
    return (f"{' and '.join(set_keys)} set ({where_set(recipe, set_keys[0])}): this project compiles each decoder "
            "layer with inductor's default mode (torch_compile: true, docs/compile.md) and cannot run another backend "
            f"or mode; remove {', '.join(set_keys)} and set torch_compile: true")


def liger_kernels_we_do_not_offer(recipe: Recipe, ctx: LintContext) -> str | None:
    # TrainingArguments (and TRL's SFTConfig) parse the key; without liger-kernel installed transformers' Trainer
    # would raise ImportError after the data is built. Not offered: not in our requirements, its kernels unverified.
    if not recipe.values.get("use_liger_kernel"):
        return None
    return (f"use_liger_kernel set ({where_set(recipe, 'use_liger_kernel')}): this project does not offer Liger's "
            "Triton kernels (liger-kernel is not in its requirements and nothing here checks them, docs/kernels.md); "
            "remove use_liger_kernel -- the model's own layers run instead, and torch_compile: true fuses each "
            "decoder layer")


def fp8_this_machine_cannot_train(recipe: Recipe, ctx: LintContext) -> str | None:
    return fp8_problem(recipe.model.use_peft) if recipe.training.fp8 else None


def eval_strategy_without_eval_rows(recipe: Recipe, ctx: LintContext) -> str | None:
    """transformers refuses it in the Trainer, after the model is loaded, with a traceback on every rank."""
    strategy = recipe.training.eval_strategy  # transformers' IntervalStrategy, a str enum: == "no" compares
    if strategy != "no" and not recipe.data.test_split_size and not recipe.data.eval_datasets:
        return (f"eval_strategy: {strategy.value} evaluates, but the recipe holds out no eval rows: set "
                "test_split_size (e.g. 0.05) or eval_datasets, or eval_strategy: no")
    return None


def benchmark_tasks_that_cannot_be_scored(recipe: Recipe, ctx: LintContext) -> str | None:
    """eval_tasks read now (task names, task files, metrics, the gate's tasks), not after training."""
    training = recipe.training
    if not training.eval_tasks and training.eval_max_regression is None:
        return None
    from sft_recipes.scores.tasks import check_max_regression, parse_tasks  # lm_eval only for a recipe with tasks

    try:
        tasks = parse_tasks(training.eval_tasks, training.eval_limit, training.eval_num_fewshot)
        check_max_regression(training.eval_max_regression, tasks)
    except ValueError as err:
        return str(err)
    return None


RULES = (
    activation_checkpointing_twice,
    trl_packing_with_block_packing,
    block_packing_needs_chat_data,
    unpacked_stream_without_max_steps,
    streamed_rows_counted_in_a_worker,
    packing_architecture_needs_our_fixes,
    hybrid_model_without_reference_kernels,
    wrap_class_absent_from_model,
    cpu_offload_without_accelerator,
    bf16_without_hardware_support,
    mixed_precision_differs_from_launch,
    batch_the_world_cannot_produce,
    sequence_parallel_with_trl_packing,
    sequence_parallel_without_block_packing,
    sequence_parallel_on_image_data,
    sequence_parallel_attention_implementation,
    sequence_parallel_size_not_dividing_the_world,
    block_length_not_divisible_by_sequence_parallel_size,
    sequence_parallel_size_the_heads_cannot_take,
    sequence_parallel_without_global_token_count,
    parallelism_config_these_recipes_cannot_run,
    activation_offloading_without_accelerator,
    torch_compile_settings_we_do_not_run,
    liger_kernels_we_do_not_offer,
    fp8_this_machine_cannot_train,
    eval_strategy_without_eval_rows,
    benchmark_tasks_that_cannot_be_scored,
)


# The rules a recipe meets or fails whatever the world: which sequence-parallel sizes the planner may suggest.
SEQUENCE_PARALLEL_RULES = (
    sequence_parallel_with_trl_packing,
    sequence_parallel_without_block_packing,
    sequence_parallel_on_image_data,
    sequence_parallel_attention_implementation,
    sequence_parallel_size_the_heads_cannot_take,
    sequence_parallel_without_global_token_count,
)


def sequence_parallel_sizes_the_recipe_takes(recipe: Recipe, ctx: LintContext, sizes: list[int]) -> list[int]:
    """Of ``sizes``, those the recipe would launch with (1 always): its data, attention and the model's heads. A
    layout's world and block length are checked where the layout is made."""
    taken = []
    for sp in sizes:
        training = copy.copy(recipe.training)
        training.sequence_parallel_size = sp
        trial = dataclasses.replace(recipe, training=training)
        if sp == 1 or not any(rule(trial, ctx) for rule in SEQUENCE_PARALLEL_RULES):
            taken.append(sp)
    return taken


def lint_recipe(recipe: Recipe, ctx: LintContext | None = None) -> None:
    ctx = ctx or LintContext.from_environment()
    problems = [message for rule in RULES if (message := rule(recipe, ctx))]
    if problems:
        raise RecipeError(f"{recipe.source}: " + "; ".join(problems) + ".")
