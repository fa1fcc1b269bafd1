"""The run a plan is made for: `TrainingSetup`, and how a recipe and its launch become one.

`training_setup` maps what the launcher and the recipe say (world size, batch, sequence length,
precision, checkpointing, sequence parallelism, offloading, HSDP replicas) onto a `TrainingSetup`;
`launch_mesh` reads the launch's nodes and replicas, `header_gpu` the GPU a recipe says it is for.
Every model above this one (memory, time and communication, layouts) prices a `TrainingSetup`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from sft_recipes.batching import derive_gradient_accumulation
from sft_recipes.loading import DTYPES

if TYPE_CHECKING:
    from sft_recipes.config import Recipe
    from sft_recipes.launch import AccelerateConfig

LossImplementation = Literal["fused_lm_head", "full_logits"]


@dataclass(frozen=True)
class TrainingSetup:
    """The run as the planner needs it. Defaults are this project's stack (TRL 1.16 SFTTrainer,
    accelerate FSDP2 with ``mixed_precision: bf16``)."""

    world_size: int
    micro_batch_size: int  # sequences per device per forward
    seq_len: int  # tokens per sequence (packed block length)
    gradient_accumulation_steps: int = 1
    activation_checkpointing: bool = True
    attn_implementation: str = "sdpa"  # "eager" materialises the S x S scores
    weights_dtype: torch.dtype = torch.bfloat16  # dtype the checkpoint is loaded in
    compute_dtype: torch.dtype = torch.bfloat16  # FSDP2 MixedPrecisionPolicy.param_dtype
    reduce_dtype: torch.dtype = torch.bfloat16  # FSDP2 MixedPrecisionPolicy.reduce_dtype (accelerate: = compute)
    fp32_master_weights: bool = True  # trainable params kept in fp32 (accelerate upcasts them)
    loss_implementation: LossImplementation = "fused_lm_head"  # TRL 1.16 SFTTrainer; "full_logits" = model(labels=...)
    dataset_sequences: int | None = None  # sequences (packed blocks) in one epoch, when known
    mfu: float = 0.4
    sequence_parallel_size: int = 1  # ranks sharing each block (Ulysses): each holds seq_len / N of its tokens
    activation_offloading: bool = False  # TRL's saved-tensor hooks: activations wait for backward on the host
    eval_micro_batch_size: int | None = None  # sequences per device per eval forward; None: the run does not evaluate
    replicate_size: int = 1  # HSDP: parameters sharded over world_size / replicate_size ranks, replicated this often
    torch_compile: bool = False  # each decoder layer compiled before FSDP2 wrapping (sft_recipes.compile); not in the estimates
    fp8: bool = False  # the decoder layers' Linear layers in float8 (sft_recipes.fp8); estimated as bf16

    def __post_init__(self) -> None:
        for name in ("world_size", "micro_batch_size", "seq_len", "gradient_accumulation_steps",
                     "sequence_parallel_size", "replicate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}: fix the recipe.")
        sp = self.sequence_parallel_size
        if self.world_size % sp or self.seq_len % sp:
            raise ValueError(f"sequence_parallel_size={sp} must divide the world size ({self.world_size}) and the "
                             f"block length ({self.seq_len}): choose another size or max_length.")
        if self.world_size % self.replicate_size:
            raise ValueError(f"replicate_size={self.replicate_size} must divide the world size ({self.world_size}): "
                             "parallelism_config_dp_replicate_size x dp_shard_size must equal num_processes.")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {self.mfu}: pass a fraction such as 0.4.")
        if self.loss_implementation not in ("fused_lm_head", "full_logits"):
            raise ValueError(f"loss_implementation {self.loss_implementation!r}: use 'fused_lm_head' or 'full_logits'.")

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch_size * self.seq_len

    @property
    def tokens_per_rank(self) -> int:
        """Tokens of a micro-batch one rank holds: its 1/N of each block under sequence parallelism."""
        return self.tokens_per_micro_batch // self.sequence_parallel_size

    @property
    def shard_size(self) -> int:
        """Ranks one parameter is sharded over: the world (flat FSDP) or one HSDP replica."""
        return self.world_size // self.replicate_size

    @property
    def data_parallel_size(self) -> int:
        """Groups that read distinct blocks: the world over the sequence-parallel size."""
        return self.world_size // self.sequence_parallel_size


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def training_setup(recipe: Recipe, accelerate_config: AccelerateConfig | None, world_size: int,
                   dataset_sequences: int | None = None, replicate_size: int = 1) -> TrainingSetup:
    m, t = recipe.model, recipe.training
    fsdp = accelerate_config.fsdp if accelerate_config else {}
    # A config without mixed_precision leaves it to the recipe (TrainingArguments' bf16 sets it for accelerate).
    mixed_precision = str((accelerate_config or {}).get("mixed_precision") or ("bf16" if t.bf16 else "no")).lower()
    compute = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    accumulation, _ = derive_gradient_accumulation(t, world_size)  # counts sequence-parallel groups itself
    return TrainingSetup(
        world_size=world_size,
        micro_batch_size=t.per_device_train_batch_size,
        seq_len=t.max_length,
        gradient_accumulation_steps=accumulation,
        activation_checkpointing=bool(t.activation_checkpointing or fsdp.get("fsdp_activation_checkpointing")),
        attn_implementation=m.attn_implementation or "sdpa",
        weights_dtype=DTYPES.get(m.dtype, torch.float32),
        compute_dtype=compute,
        reduce_dtype=DTYPES[t.fsdp_reduce_dtype] if mixed_precision != "no" else torch.float32,
        fp32_master_weights=mixed_precision != "no" or m.dtype == "float32",
        dataset_sequences=dataset_sequences,
        sequence_parallel_size=t.sequence_parallel_size,
        activation_offloading=t.activation_offloading,
        eval_micro_batch_size=t.per_device_eval_batch_size if recipe.data.eval_datasets or recipe.data.test_split_size
        else None,
        replicate_size=replicate_size,
        torch_compile=t.torch_compile,
        fp8=t.fp8,
    )


def header_gpu(recipe_path: str | Path) -> str:
    """The GPU a recipe's first line says it is for ("-- 1 node x 8 B300 288GB"), else H100."""
    path = Path(recipe_path)
    first = path.read_text().splitlines()[:1] if path.is_file() else []
    named = re.search(r"\b(H100|H200|B200|B300)\b", first[0]) if first else None
    return named.group(1) if named else "H100"


def launch_mesh(accelerate_config: AccelerateConfig | None, world_size: int) -> tuple[int, int]:
    """(nodes, HSDP replicas) of the launch: the config's processes per node kept when --world_size
    changes the total (8-GPU nodes without a config), and its parallelism_config replicate size."""
    per_node = accelerate_config.processes_per_node if accelerate_config else 8
    nodes = world_size // per_node if world_size % per_node == 0 else 1
    parallelism = accelerate_config.parallelism if accelerate_config else None
    return max(nodes, 1), parallelism.dp_replicate if parallelism else 1
