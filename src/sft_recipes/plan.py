"""Know before you launch: the FSDP2 memory and time plan of a recipe, and `--dry-run`.

Runs on the CPU in seconds without weights: counts and FLOPs come from `model_math` (the model on
the meta device), memory and time from the closed-form model documented on each function.
`plan_recipe` maps what the launcher and the recipe say (world size, batch, sequence length,
precision, checkpointing, LoRA) onto `TrainingSetup`; `scripts/sft.py RECIPE --dry-run` prints it.

Memory model, per GPU, FSDP2 full shard over ``world_size`` ranks (bytes, reported in GiB):

- params      every parameter, sharded: frozen ones in the dtype they are loaded in, trainable
              ones in fp32 when ``fp32_master_weights`` (accelerate's FSDP2 preparation upcasts
              trainable parameters to fp32 whenever ``mixed_precision`` is not "no") and in the
              load dtype otherwise (a plain-torch FSDP2 loop on a bf16 model, as the seeds run).
- grads       trainable parameters only, sharded, in the trainable parameters' dtype; counted
              whole (true from the second accumulation micro-step on).
- optimizer   AdamW ``exp_avg`` + ``exp_avg_sq``, sharded. torch keeps them in the parameter's
              dtype (``zeros_like(param)``): fp32 with master weights, bf16 on a bf16 model. The
              fp32 master copy is the ``params`` line itself; FSDP2 keeps no second copy.
- unsharded_params
              FSDP2 all-gathers in the compute dtype. The root unit (everything outside the
              no-split modules: embeddings, LM head, final norm) stays gathered from forward
              through backward (FSDP2 does not reshard the root after forward), plus three units
              worth: the unit computing, the one prefetched, and the prefetched one's flat
              all-gather buffer until it is copied out into the unsharded parameters.
- reduce_buffers
              unsharded gradients of a unit in the compute dtype, plus their copy in the reduce
              dtype when it differs (FSDP2 casts before reduce-scatter).
- activations see `activation_bytes_per_token`. Per token the rank holds: with sequence parallelism
              over N ranks (``sequence_parallel_size``) a rank holds 1/N of each block's tokens, and
              inside the token-mixing ops its 1/N of the heads over the whole block, which is the same
              bytes per held token (see `_layer_activations` for what SP adds). With activation
              offloading (TRL's ``activation_offloading``) what autograd keeps between a layer's
              forward and its backward is on the host instead (see `_held_bytes_per_token`).
- all_to_all  sequence parallelism's exchange buffers of one layer: the send and receive copies of
              every tensor it trades (see `_exchange_bytes_per_token`).
- loss        the final norm and vocabulary buffers (see `_loss_buffer_bytes`), and a trainable
              LM head's unsharded gradient, held from the start of backward to the root's
              reduce-scatter.
- lora_transient
              LoRA on ``target_parameters`` (peft ``ParamWrapper``) materialises ``W + B @ A`` for
              the whole targeted tensor on every forward (all experts at once) and keeps it for
              backward, whose gradient has that size too: 2 x the targeted parameters of one layer
              in the compute dtype with activation checkpointing; every layer's merged weights
              plus one gradient without.
- overhead    CUDA context, NCCL buffers and cuBLAS workspaces (a fixed allowance) plus allocator
              fragmentation (a fraction of everything above).

The transient parts peak at different moments, so the total is taken at the largest of three
(`MemoryEstimate.peak_at`): the loss backward, the backward of the largest decoder layer, and the
root unit's reduce-scatter at the end of backward.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from transformers import PretrainedConfig

from sft_recipes.batching import derive_gradient_accumulation
from sft_recipes.communication import Links
from sft_recipes.errors import RecipeError
from sft_recipes.launch import AccelerateConfig, config_for_recipe, header_accelerate_config, planned_world_size
from sft_recipes.layouts import LayoutReport, format_layouts, layout_report, shard_group_shortfall
from sft_recipes.loading import DTYPES, read_model_config
from sft_recipes.model_math import (
    GPU_BY_NAME, GPUS, ParamCounts, attention_flops_per_token, count_parameters, flops_per_token, head_dim,
    layer_types, num_experts, text_config_of,
)

if TYPE_CHECKING:
    from peft import LoraConfig

    from sft_recipes.config import Recipe

GIB = 1024**3

# Outside the PyTorch allocator: CUDA context (~0.5 GiB), NCCL communicator buffers (~1 GiB with
# the default channels) and cuBLAS/cuDNN workspaces.
CUDA_CONTEXT_GIB = 2.0
# Caching-allocator fragmentation: blocks freed but not reusable for the next request's size.
FRAGMENTATION_FRACTION = 0.05

# TRL 1.16's fused LM head (trl/kernels/chunked_logprob.py) projects in tiles of this many tokens by
# this many vocabulary entries (``TOKEN_CHUNK_SIZE`` and ``_CHUNKED_LOGPROB_CHUNK_SIZE``).
FUSED_HEAD_TOKEN_TILE = 4096
FUSED_HEAD_VOCAB_TILE = 32768

# flash-linear-attention's chunked gated delta rule keeps a chunk-local fp32 matrix per value head.
GATED_DELTA_CHUNK = 64
# TRL's OffloadActivations(max_fwd_stash_size=5): saved tensors still on the GPU while their copy to
# the host runs, at most this many, during the forward.
OFFLOAD_FORWARD_STASH = 5
# Eager attention implementations whose softmax stays in the compute dtype; the others (llama,
# qwen3, qwen3_5, mixtral, ...) take it in fp32 and cast back, keeping both.
_EAGER_SOFTMAX_IN_COMPUTE_DTYPE = {"gpt_oss"}

LossImplementation = Literal["fused_lm_head", "full_logits"]

# --------------------------------------------------------------------------------------------
# Memory


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


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class _LayerActivations:
    saved: float  # bytes per token autograd keeps for the layer's backward
    working: float  # bytes per token of gradient temporaries while that backward runs
    exchange: float = 0.0  # bytes per token of sequence parallelism's all-to-all send + receive buffers


def _layer_activations(text_config: PretrainedConfig, layer_type: str, setup: TrainingSetup) -> _LayerActivations:
    """Per-token activation bytes of one decoder layer (b = compute dtype bytes).

    Saved for backward:
    - two RMSNorms: the fp32 upcast input (4h) and the normalised output (b h) each;
    - softmax attention (flash / sdpa): q, k, v after RoPE and the attention output,
      b (2 q + 2 kv) with q = heads x head_dim, kv = kv_heads x head_dim, plus the fp32 log-sum-exp
      per head; eager adds the S x S scores per head, the fp32 softmax output and its cast (4 + b;
      b for gpt_oss, whose softmax stays in bf16), in every layer (eager builds the full matrix
      even for sliding windows);
    - gated-delta linear attention with the flash-linear-attention kernels: the qkv projection,
      the conv output and its activation (3 x conv_dim), the z gate, core output and gated-norm
      output (3 x value_dim), b each, and the kernel's fp32 chunk matrix (4 x value_heads x 64).
      The pure-torch reference path keeps several times more (chunk matrices for every step);
    - dense gated MLP: gate, up, act(gate), act(gate) * up: 4 b I;
    - MoE: fp32 router logits (4 E) + for each of top_k routed copies the gathered input and the
      expert output (2 h) and the gated MLP intermediates (4 I_expert), b each.
    Working set of the layer's backward: two gradients of the widest intermediate (2 b x the MLP
    width, top_k x I_expert for MoE, or the conv width), and under eager the scores' gradients
    (4 + b per score, 2 b for gpt_oss). Checked against CPU measurements in tests/test_plan.py.

    All of it is per token the rank holds. Under sequence parallelism over N ranks the token-mixing
    op keeps H/N heads for all L tokens of the block, i.e. H heads per held token, as without SP;
    two things are added for softmax attention: the out projection's input (b q) is the inverse
    all-to-all's own tensor, no longer the attention output the kernel keeps, and when N exceeds
    the kv heads K every rank keeps one replicated kv head over the block (2 b d (N - K) more per
    held token). The gated-delta layer's exchanged tensors are the ones listed above, held per head
    over the block instead of per token over all heads: the same bytes.
    """
    b = _bytes(setup.compute_dtype)
    h = text_config.hidden_size
    saved = 2 * (4 * h + b * h)
    scores_saved = scores_working = 0
    if layer_type == "linear_attention":
        key_dim = text_config.linear_num_key_heads * text_config.linear_key_head_dim
        value_dim = text_config.linear_num_value_heads * text_config.linear_value_head_dim
        conv_dim = 2 * key_dim + value_dim
        chunk_matrix = 4 * text_config.linear_num_value_heads * GATED_DELTA_CHUNK
        saved += b * (3 * conv_dim + 3 * value_dim) + chunk_matrix
        widest = conv_dim
    else:
        heads = text_config.num_attention_heads
        dim = head_dim(text_config)
        kv = getattr(text_config, "num_key_value_heads", None) or heads
        saved += b * (2 * heads * dim + 2 * kv * dim) + 4 * heads
        sp = setup.sequence_parallel_size
        if sp > 1:
            saved += b * heads * dim + 2 * b * dim * (sp * _kv_heads_per_rank(kv, sp) - kv)
        widest = heads * dim
        if setup.attn_implementation == "eager":
            # fp32 softmax: its output and the cast kept, fp32 + compute-dtype gradients in backward;
            # compute-dtype softmax (gpt_oss): the probabilities kept, two such gradients in backward
            low_precision = text_config.model_type in _EAGER_SOFTMAX_IN_COMPUTE_DTYPE
            scores_saved = heads * setup.seq_len * (b if low_precision else 4 + b)
            scores_working = heads * setup.seq_len * (2 * b if low_precision else 4 + b)
    experts = num_experts(text_config)
    if experts:
        expert_intermediate = getattr(text_config, "moe_intermediate_size", None) or text_config.intermediate_size
        top_k = text_config.num_experts_per_tok
        saved += 4 * experts + top_k * b * (2 * h + 4 * expert_intermediate)
        widest = max(widest, top_k * expert_intermediate)
    else:
        saved += 4 * b * text_config.intermediate_size
        widest = max(widest, text_config.intermediate_size)
    return _LayerActivations(saved=saved + scores_saved, working=2 * b * widest + scores_working,
                             exchange=_exchange_bytes_per_token(text_config, layer_type, setup))


def _kv_heads_per_rank(kv_heads: int, sp: int) -> int:
    """kv heads one rank attends with: an even share, or one replicated head when sp exceeds them."""
    return max(kv_heads // sp, 1)


def _exchange_bytes_per_token(text_config: PretrainedConfig, layer_type: str, setup: TrainingSetup) -> float:
    """All-to-all buffers of one layer under sequence parallelism, per token the rank holds.

    Each exchange (`sequence_parallel.seq_to_heads` / `heads_to_seq`) copies what it sends into
    per-rank pieces and receives into as many, b bytes each way per element. Softmax attention
    trades q, k, v and the output (k and v as N x the kv heads per rank: replicated heads are sent
    to every rank that reads them); a gated-delta layer trades the conv input and output (conv
    width each), the recurrence's q, k, v (conv width), its fp32 gate and b beta (one per value
    head each) and its output (value width). Counted for the whole layer, as the backward's
    gradient exchanges are the same sizes.
    """
    sp = setup.sequence_parallel_size
    if sp == 1:
        return 0.0
    b = _bytes(setup.compute_dtype)
    if layer_type == "linear_attention":
        key_dim = text_config.linear_num_key_heads * text_config.linear_key_head_dim
        value_dim = text_config.linear_num_value_heads * text_config.linear_value_head_dim
        conv_dim = 2 * key_dim + value_dim
        traded = b * (3 * conv_dim + value_dim) + (4 + b) * text_config.linear_num_value_heads
    else:
        heads, dim = text_config.num_attention_heads, head_dim(text_config)
        kv = getattr(text_config, "num_key_value_heads", None) or heads
        traded = b * dim * (2 * heads + 2 * sp * _kv_heads_per_rank(kv, sp))
    return 2 * traded  # send and receive


def _model_layer_activations(config: PretrainedConfig, setup: TrainingSetup) -> list[_LayerActivations]:
    text_config = text_config_of(config)
    return [_layer_activations(text_config, layer_type, setup) for layer_type in layer_types(text_config)]


def _held_bytes_per_token(layers: list[_LayerActivations], hidden: int, b: int, checkpointing: bool,
                          offloading: bool = False) -> float:
    """Kept on the GPU from forward until each layer's backward: every layer's input under
    checkpointing, everything each layer saved without.

    TRL's activation offloading (``OffloadActivations``, a ``saved_tensors_hooks``) moves every
    saved tensor of 1 KiB or more to the host in forward and back when backward unpacks it. Under
    non-reentrant checkpointing the checkpoint's own hooks take the layer's internals (recomputed,
    never saved) and the offloading hooks see the layer inputs (saved by the checkpoint's input
    saver outside them): those go to the host. On the GPU stays the one the running backward
    brought back: one layer input with checkpointing, one layer's saved tensors without.
    """
    if offloading:
        return b * hidden if checkpointing else max(layer.saved for layer in layers)
    return len(layers) * b * hidden if checkpointing else sum(layer.saved for layer in layers)


def _offload_stash_bytes_per_token(layers: list[_LayerActivations], hidden: int, b: int, checkpointing: bool) -> float:
    """Forward stash of TRL's offloading at the end of forward: up to five saved tensors whose copy
    to the host is in flight (layer inputs with checkpointing; at most the last layer's saved without)."""
    if checkpointing:
        return min(OFFLOAD_FORWARD_STASH, len(layers)) * b * hidden
    return layers[-1].saved


def activation_bytes_per_token(config: PretrainedConfig, setup: TrainingSetup, checkpointing: bool) -> float:
    """Activation bytes per token the rank holds while the largest layer runs its backward.

    With checkpointing every decoder layer keeps only its input (b h) and that layer is recomputed
    (its saved activations plus its gradient working set); without, every layer keeps all it saved.
    """
    layers = _model_layer_activations(config, setup)
    hidden, b = text_config_of(config).hidden_size, _bytes(setup.compute_dtype)
    held = _held_bytes_per_token(layers, hidden, b, checkpointing, setup.activation_offloading)
    if checkpointing:
        return held + max(layer.saved + layer.working for layer in layers)
    return held + max(layer.working for layer in layers)


def _loss_buffer_bytes(config: PretrainedConfig, counts: ParamCounts, setup: TrainingSetup) -> float:
    """Buffers while the loss runs its backward, for the T tokens of a micro-batch the rank holds, vocab V: the final
    norm's activations and the vocabulary buffers.

    full_logits (transformers' ForCausalLMLoss): bf16 logits (b), their fp32 upcast kept as the
    log-softmax output (4), and in backward the fp32 gradient of the log-probabilities and of the
    logits (4 + 4): T V (b + 12). fused_lm_head (TRL 1.16): a 4096-token x 32768-column tile in the
    compute dtype (allocated at full width whatever V is) and fp32 gradient accumulators for the
    hidden states (4 T h) and, when the head trains, for the head weight (4 V h).
    """
    text_config = text_config_of(config)
    b = _bytes(setup.compute_dtype)
    tokens, vocab, hidden = setup.tokens_per_rank, text_config.vocab_size, text_config.hidden_size
    final_norm = tokens * hidden * (4 + b)  # the last RMSNorm's fp32 input and output, as in a layer
    if setup.loss_implementation == "full_logits":
        return final_norm + tokens * vocab * (b + 12)
    tile = b * min(tokens, FUSED_HEAD_TOKEN_TILE) * FUSED_HEAD_VOCAB_TILE
    head_accumulator = 4 * vocab * hidden if counts.output_head_trainable else 0
    return final_norm + tile + 4 * tokens * hidden + head_accumulator


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU memory in GiB at the peak moment; ``total`` is the sum of the components.

    The peak is the largest of three moments of the step (``peak_at``): "loss backward" (vocabulary
    buffers live), "layer backward" (one layer recomputed and differentiated) and "root
    reduce-scatter" (the end of backward: the root unit's gradients unsharded and cast for reduction).
    Parameters, gradients, optimizer state and the gathered root unit are there at all three.
    """

    params: float
    grads: float
    optimizer: float
    unsharded_params: float
    reduce_buffers: float
    activations: float
    all_to_all: float
    loss: float
    lora_transient: float
    overhead: float
    total: float
    peak_at: str
    activation_bytes_per_token_checkpointed: float
    activation_bytes_per_token_full: float
    activations_offloaded: float = 0.0  # GiB per GPU in the host's pinned memory (activation offloading)

    COMPONENTS = (
        "params",
        "grads",
        "optimizer",
        "unsharded_params",
        "reduce_buffers",
        "activations",
        "all_to_all",
        "loss",
        "lora_transient",
        "overhead",
    )

    @property
    def allocated(self) -> float:
        """What the PyTorch allocator holds: the total without the CUDA/NCCL/fragmentation allowance."""
        return self.total - self.overhead


def estimate_memory(
    config: PretrainedConfig,
    counts: ParamCounts,
    setup: TrainingSetup,
    cuda_context_gib: float = CUDA_CONTEXT_GIB,
) -> MemoryEstimate:
    """Peak memory per GPU under FSDP2 full shard (see the module docstring for each component).

    Sharded state is divided by the shard group (`TrainingSetup.shard_size`): the world under flat FSDP,
    one replica under HSDP. ``cuda_context_gib=0`` drops the fixed allowance (a CPU run has no CUDA
    context or NCCL).
    """
    ws = setup.shard_size
    weights_b, compute_b, reduce_b = map(_bytes, (setup.weights_dtype, setup.compute_dtype, setup.reduce_dtype))
    trainable_b = 4 if setup.fp32_master_weights else weights_b
    # FSDP2 casts unsharded gradients to reduce_dtype into a second buffer before reduce-scatter
    gradient_b = compute_b + (reduce_b if reduce_b != compute_b else 0)
    text_config = text_config_of(config)
    tokens, hidden = setup.tokens_per_rank, text_config.hidden_size
    checkpointing, offloading = setup.activation_checkpointing, setup.activation_offloading

    layers = _model_layer_activations(config, setup)
    held = tokens * _held_bytes_per_token(layers, hidden, compute_b, checkpointing, offloading)
    offloaded = tokens * _held_bytes_per_token(layers, hidden, compute_b, checkpointing) - held if offloading else 0
    stash = tokens * _offload_stash_bytes_per_token(layers, hidden, compute_b, checkpointing) if offloading else 0
    per_token = {ckpt: activation_bytes_per_token(config, setup, ckpt) for ckpt in (True, False)}
    # The LM head's unsharded gradient lives from the start of backward until the root reduce-scatter.
    head_grad = compute_b * text_config.vocab_size * hidden if counts.output_head_trainable else 0
    merged = compute_b * counts.lora_targeted_per_layer  # peft ParamWrapper's W + B @ A, one layer
    merged_held = 0 if checkpointing else len(layers) * merged

    moments = {
        "loss backward": {
            "activations": held + stash,
            "loss": _loss_buffer_bytes(config, counts, setup) + head_grad,
            "lora_transient": merged_held,
        },
        "layer backward": {
            "activations": tokens * per_token[checkpointing],
            "all_to_all": tokens * max(layer.exchange for layer in layers),
            "loss": head_grad,
            "reduce_buffers": counts.largest_unit_trainable * gradient_b,
            "lora_transient": merged_held + (merged if not checkpointing else 2 * merged),
        },
        "root reduce-scatter": {"reduce_buffers": counts.root_trainable * gradient_b},
    }
    peak_at = max(moments, key=lambda moment: sum(moments[moment].values()))
    parts = {
        "params": (counts.frozen * weights_b + counts.trainable * trainable_b) / ws,
        "grads": counts.trainable * trainable_b / ws,
        "optimizer": 2 * counts.trainable * trainable_b / ws,  # AdamW exp_avg + exp_avg_sq
        "unsharded_params": (counts.root + 3 * counts.largest_unit) * compute_b,
        "reduce_buffers": 0.0,
        "activations": 0.0,
        "all_to_all": 0.0,
        "loss": 0.0,
        "lora_transient": 0.0,
        **moments[peak_at],
    }
    allocated = sum(parts.values())
    parts["overhead"] = cuda_context_gib * GIB + FRAGMENTATION_FRACTION * allocated
    gib = {name: value / GIB for name, value in parts.items()}
    return MemoryEstimate(
        **gib,
        total=sum(gib.values()),
        peak_at=peak_at,
        activation_bytes_per_token_checkpointed=per_token[True],
        activation_bytes_per_token_full=per_token[False],
        activations_offloaded=offloaded / GIB,
    )


def estimate_eval_gib(config: PretrainedConfig, setup: TrainingSetup, memory: MemoryEstimate) -> float | None:
    """Peak GiB per GPU while evaluating (`sft_recipes.evaluation`), or None when the run does not.

    No gradients: params, optimizer state and the gathered unit stay (grads were freed by zero_grad),
    the forward keeps one layer's activations at a time (b h + the largest layer's saved set, per
    token, over the whole block: under sequence parallelism each rank evaluates its rows whole), and
    the loss is TRL's fused head as in training (one tile of logits at a time); with
    `loss_implementation: full_logits`, the full logits with their fp32 upcast and log-softmax, T V (b + 8).
    """
    if setup.eval_micro_batch_size is None:
        return None
    text_config = text_config_of(config)
    b = _bytes(setup.compute_dtype)
    tokens = setup.eval_micro_batch_size * setup.seq_len
    forward = tokens * (b * text_config.hidden_size + max(layer.saved for layer in _model_layer_activations(config, setup)))
    if setup.loss_implementation == "full_logits":
        logits = tokens * text_config.vocab_size * (b + 8)
    else:
        logits = b * min(tokens, FUSED_HEAD_TOKEN_TILE) * FUSED_HEAD_VOCAB_TILE
    allocated = (memory.params + memory.optimizer + memory.unsharded_params) * GIB + forward + logits
    return (allocated * (1 + FRAGMENTATION_FRACTION)) / GIB + CUDA_CONTEXT_GIB


def fit_table(memory: MemoryEstimate) -> dict[str, float]:
    """Headroom in GiB per GPU type (negative: does not fit)."""
    return {gpu.name: gpu.memory_gib - memory.total for gpu in GPUS}


# --------------------------------------------------------------------------------------------
# Time


def estimate_step_time(config: PretrainedConfig, counts: ParamCounts, setup: TrainingSetup, gpu: str) -> float:
    """Seconds per optimizer step on ``gpu``: each device trains micro_batch x seq_len / sequence_parallel_size
    x accumulation tokens at `flops_per_token` (whose attention term is over the whole block: under SP
    a rank attends for its heads over all of it), at ``setup.mfu`` of the GPU's dense bf16 peak.
    Activation offloading's host copies are taken as hidden behind compute (TRL runs them on a side stream)."""
    if gpu not in GPU_BY_NAME:
        raise ValueError(f"Unknown GPU {gpu!r}: use one of {sorted(GPU_BY_NAME)}.")
    tokens_per_device = setup.tokens_per_rank * setup.gradient_accumulation_steps
    flops = tokens_per_device * flops_per_token(config, counts, setup.seq_len)
    return flops / (setup.mfu * GPU_BY_NAME[gpu].peak_bf16_flops)


# --------------------------------------------------------------------------------------------
# Plan


@dataclass(frozen=True)
class Plan:
    model_type: str
    counts: ParamCounts
    setup: TrainingSetup
    memory: MemoryEstimate
    flops_per_token: float
    attention_flops_per_token: float
    seconds_per_step: dict[str, float]
    headroom_gib: dict[str, float]
    eval_gib: float | None = None  # peak per GPU while evaluating; None: the run does not evaluate

    @property
    def sequences_per_step(self) -> int:
        s = self.setup
        return s.micro_batch_size * s.gradient_accumulation_steps * s.data_parallel_size

    @property
    def tokens_per_step(self) -> int:
        return self.sequences_per_step * self.setup.seq_len

    @property
    def steps_per_epoch(self) -> int | None:
        if self.setup.dataset_sequences is None:
            return None
        # Every epoch ends on a whole global batch (fault/world_size.py): the partial tail is not trained.
        return self.setup.dataset_sequences // self.sequences_per_step

    @property
    def fits(self) -> dict[str, bool]:
        return {gpu: headroom >= 0 for gpu, headroom in self.headroom_gib.items()}

    def to_dict(self) -> dict:
        memory = asdict(self.memory)
        setup = {k: _dtype_name(v) if isinstance(v, torch.dtype) else v for k, v in asdict(self.setup).items()}
        counts = asdict(self.counts)
        counts["decoder_layers"] = list(self.counts.decoder_layers)
        return {
            "model_type": self.model_type,
            "total_params": self.counts.total,
            "trainable_params": self.counts.trainable,
            "world_size": self.setup.world_size,
            "sequence_parallel_size": self.setup.sequence_parallel_size,
            "data_parallel_size": self.setup.data_parallel_size,
            "sequences_per_step": self.sequences_per_step,
            "tokens_per_step": self.tokens_per_step,
            "steps_per_epoch": self.steps_per_epoch,
            "per_device_memory_gib": {name: memory[name] for name in (*MemoryEstimate.COMPONENTS, "total")},
            "memory_peak_at": self.memory.peak_at,
            "activations_offloaded_gib": self.memory.activations_offloaded,
            "activation_bytes_per_token": {
                "checkpointed": self.memory.activation_bytes_per_token_checkpointed,
                "full": self.memory.activation_bytes_per_token_full,
            },
            "fits": self.fits,
            "headroom_gib": self.headroom_gib,
            "flops_per_token": self.flops_per_token,
            "attention_flops_per_token": self.attention_flops_per_token,
            "mfu": self.setup.mfu,
            "seconds_per_step": self.seconds_per_step,
            "eval_peak_gib": self.eval_gib,
            "setup": setup,
            "counts": counts,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def make_plan(model: PretrainedConfig | str | Path, setup: TrainingSetup, lora: LoraConfig | None = None) -> Plan:
    """Count, estimate memory and time for ``model`` (a config, a local path or a cached Hub id)."""
    config = model if isinstance(model, PretrainedConfig) else read_model_config(model, download=False)
    counts = count_parameters(config, lora)
    memory = estimate_memory(config, counts, setup)
    return Plan(
        model_type=config.model_type,
        counts=counts,
        setup=setup,
        memory=memory,
        flops_per_token=flops_per_token(config, counts, setup.seq_len),
        attention_flops_per_token=attention_flops_per_token(config, setup.seq_len),
        seconds_per_step={gpu.name: estimate_step_time(config, counts, setup, gpu.name) for gpu in GPUS},
        headroom_gib=fit_table(memory),
        eval_gib=estimate_eval_gib(config, setup, memory),
    )


def _billions(n: float) -> str:
    return f"{n / 1e9:,.3f}B"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def format_plan(plan: Plan) -> str:
    """The plan as a table a person reads before launching: every factor behind every figure."""
    s, c, m = plan.setup, plan.counts, plan.memory
    trainable_dtype = "float32" if s.fp32_master_weights else _dtype_name(s.weights_dtype)
    tokens_per_device = s.tokens_per_rank * s.gradient_accumulation_steps
    head = f"LM head {c.output_head:,}" if c.output_head else "LM head tied"
    loss = {"fused_lm_head": "TRL's chunked LM head, no full logits", "full_logits": "full logits, fp32 loss"}
    sp = s.sequence_parallel_size
    offloaded = (f"; offloaded to host memory {m.activations_offloaded:,.2f} GiB per device"
                 if s.activation_offloading else "; not offloaded")

    def row(label: str, text: str) -> str:
        return f"  {label:<18}{text}"

    lines = [
        f"Plan for {plan.model_type}",
        row("parameters", f"total {c.total:,} ({_billions(c.total)}), trainable {c.trainable:,} "
            f"({100 * c.trainable / c.total:.2f}%)"),
        row("", f"embedding {c.embedding:,}, {head}, {len(c.decoder_layers)} decoder layers, "
            f"largest FSDP unit {c.largest_unit:,}, root {c.root:,}"),
        *(row("LoRA rank", f"{target}: {', '.join(map(str, ranks))}") for target, ranks in c.lora_ranks.items()),
        row("batch", f"{s.micro_batch_size} seq/{'device' if sp == 1 else 'group'} x {s.seq_len} tokens x "
            f"{s.gradient_accumulation_steps} accumulation x {s.data_parallel_size} "
            f"{'devices' if sp == 1 else 'groups'} = {plan.sequences_per_step:,} sequences = "
            f"{plan.tokens_per_step:,} tokens per optimizer step"),
        row("sequence parallel", "off (SP 1: every device holds whole blocks)" if sp == 1 else
            f"SP {sp}: {s.data_parallel_size} groups of {sp} devices share each block, {s.tokens_per_rank:,} "
            f"tokens per device, all-to-all around every token-mixing op"),
    ]
    if plan.steps_per_epoch is not None:
        lines.append(row("steps per epoch", f"{s.dataset_sequences:,} sequences / {plan.sequences_per_step:,} "
                         f"= {plan.steps_per_epoch:,}"))
    lines += [
        row("precision", f"weights {_dtype_name(s.weights_dtype)}, trainable {trainable_dtype}, compute "
            f"{_dtype_name(s.compute_dtype)}, reduce {_dtype_name(s.reduce_dtype)}; "
            f"AdamW states in {trainable_dtype}"),
        row("activations", f"{m.activation_bytes_per_token_checkpointed:,.0f} B/token with checkpointing, "
            f"{m.activation_bytes_per_token_full:,.0f} B/token without; this run "
            f"{'checkpoints' if s.activation_checkpointing else 'does not checkpoint'}, "
            f"{s.attn_implementation} attention{offloaded}"),
        row("loss", f"{s.loss_implementation} ({loss[s.loss_implementation]})"),
        f"  memory per GPU (GiB), at the peak: {m.peak_at}",
        *(f"    {name:<18}{getattr(m, name):>9.2f}" for name in (*MemoryEstimate.COMPONENTS, "total")),
    ]
    if plan.eval_gib is not None:
        fits = ", ".join(gpu.name for gpu in GPUS if gpu.memory_gib >= plan.eval_gib) or "none"
        head = "full logits" if s.loss_implementation == "full_logits" else "TRL's fused head, one logit tile"
        whole = ", whole blocks under SP" if s.sequence_parallel_size > 1 else ""
        lines.append(row("eval", f"{plan.eval_gib:.2f} GiB per GPU ({s.eval_micro_batch_size} seq/device{whole}, no "
                         f"gradients: one layer's activations, {head}); fits {fits}"))
    lines += [
        row("FLOPs per token", f"{plan.flops_per_token:.4g} = {4 if c.lora_ranks else 6} x "
            f"{_billions(c.flop_params)} matmul params{' + 6 x trainable' if c.lora_ranks else ''} "
            f"+ attention {plan.attention_flops_per_token:.4g}"),
        row("step time", f"{tokens_per_device:,} tokens/device x FLOPs per token "
            f"/ ({s.mfu:.0%} MFU x dense bf16 peak)"),
        f"  {'GPU':<8}{'GiB':>9}{'fits':>6}{'headroom':>10}{'peak TFLOP/s':>14}{'s/step':>10}",
    ]
    for gpu in GPUS:
        fits = "yes" if plan.fits[gpu.name] else "NO"
        lines.append(
            f"  {gpu.name:<8}{gpu.memory_gib:>9.1f}{fits:>6}{plan.headroom_gib[gpu.name]:>10.1f}"
            f"{gpu.peak_bf16_flops / 1e12:>14,.0f}{plan.seconds_per_step[gpu.name]:>10.2f}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The recipe and the launcher -> a plan (`--dry-run`)

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
    )


def plan_recipe(recipe: Recipe, accelerate_config: AccelerateConfig | None, world_size: int,
                dataset_sequences: int | None = None, replicate_size: int = 1) -> Plan:
    lora = None
    if recipe.model.use_peft:
        from sft_recipes.lora import build_lora_config

        lora = build_lora_config(recipe.model)
    config = read_model_config(recipe.model.model_name_or_path, recipe.model.model_revision, download=False)
    return make_plan(config, training_setup(recipe, accelerate_config, world_size, dataset_sequences, replicate_size), lora)


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


def plan_dry_run(recipe_path: str, overrides: list[str], config_file: str | None = None,
                 world_size: int | None = None, plan_json: str | None = None, gpu: str | None = None,
                 intra_node_gbps: float | None = None, inter_node_gbps: float | None = None) -> str:
    """`scripts/sft.py RECIPE --dry-run`: lint the run a launch would make and return its plan, as text.

    RecipeError for anything that stops the plan (the recipe, the launcher's settings, the model's config).
    """
    accelerate_config = config_for_recipe(config_file, recipe_path)
    with accelerate_config.exported() if accelerate_config else contextlib.nullcontext():  # what lint reads
        return _dry_run_text(recipe_path, overrides, accelerate_config, config_file, world_size, plan_json, gpu,
                             intra_node_gbps, inter_node_gbps)


def _dry_run_text(recipe_path: str, overrides: list[str], accelerate_config: AccelerateConfig | None,
                  config_file: str | None, world_size: int | None, plan_json: str | None, gpu: str | None,
                  intra_node_gbps: float | None, inter_node_gbps: float | None) -> str:
    from sft_recipes.config import load_recipe
    from sft_recipes.data.mixture import has_images
    from sft_recipes.lint import LintContext, lint_recipe

    world_size = planned_world_size(accelerate_config, world_size)
    recipe = load_recipe(recipe_path, overrides, planning=True)
    model_args = recipe.model
    lint_recipe(recipe, LintContext(world_size, not recipe.values.get("use_cpu"), lambda: read_model_config(
        model_args.model_name_or_path, model_args.model_revision, download=False)))
    nodes, replicate = launch_mesh(accelerate_config, world_size)
    gpu = gpu or header_gpu(recipe_path)
    try:
        plan = plan_recipe(recipe, accelerate_config, world_size, replicate_size=replicate)
        layouts = plan_layouts(recipe, plan, accelerate_config, config_file or header_accelerate_config(recipe_path),
                               nodes, gpu, intra_node_gbps, inter_node_gbps)
    except ValueError as err:  # the model's config, or sizes the planner cannot take
        raise RecipeError(str(err)) from None
    command = f".venv/bin/accelerate launch --config_file {config_file or header_accelerate_config(recipe_path) or 'CONFIG'} " \
              f"scripts/sft.py {recipe_path} {' '.join(overrides)}".rstrip()
    text = format_plan(plan) + "\n" + format_layouts(layouts, command)
    if has_images(recipe.data):  # what the tower and the images add (vision_plan.py)
        from sft_recipes.vision_plan import vision_plan_lines

        config = read_model_config(model_args.model_name_or_path, model_args.model_revision, download=False)
        text = "\n".join([*vision_plan_lines(recipe, config, world_size), text])
    if plan_json:
        Path(plan_json).write_text(json.dumps({**plan.to_dict(), **layouts.to_dict()}, indent=2))
        text += f"\nplan written to {plan_json}"
    return text


def plan_layouts(recipe: Recipe, plan: Plan, accelerate_config: AccelerateConfig | None, config_name: str | Path | None,
                 nodes: int, gpu: str, intra_node_gbps: float | None, inter_node_gbps: float | None) -> LayoutReport:
    """The communication, FSDP-vs-HSDP and what-to-change part of the dry run; refuses an HSDP shard group
    that cannot hold the run on ``gpu`` (the shortfall and the smallest shard size that fits)."""
    config = read_model_config(recipe.model.model_name_or_path, recipe.model.model_revision, download=False)
    links = Links.for_gpu(gpu, intra_node_gbps, inter_node_gbps)
    setup = plan.setup
    if setup.replicate_size > 1:
        shortfall = shard_group_shortfall(config, plan.counts, setup, gpu)
        if shortfall is not None:
            shard = shortfall.smallest_fitting_shard
            fix = (f"the smallest shard size that fits is {shard} " + (
                   f"(parallelism_config_dp_shard_size: {shard}, parallelism_config_dp_replicate_size: "
                   f"{setup.world_size // shard})" if shard and shard < setup.world_size else
                   "(every GPU: flat FSDP, a config without parallelism_config)")
                   if shortfall.smallest_fitting_shard else
                   "no shard size fits either, flat FSDP over all ranks included: see the plan without "
                   "parallelism_config for what to change")
            raise RecipeError(f"HSDP shard group of {setup.shard_size} GPUs cannot hold this run on {gpu}: "
                              f"{shortfall.needed_gib:.1f} GiB per GPU, {shortfall.shortfall_gib:.1f} GiB more than "
                              f"its {shortfall.available_gib:.1f}; {fix}.")
    fsdp = accelerate_config.fsdp if accelerate_config else {}
    reshard = str(fsdp.get("fsdp_reshard_after_forward", True)).lower() == "true"
    t = recipe.training
    from sft_recipes.lint import LintContext, sequence_parallel_sizes_the_recipe_takes

    sequence_parallel_sizes = sequence_parallel_sizes_the_recipe_takes(  # never suggest a size the run refuses
        recipe, LintContext(setup.world_size, True, lambda: config), list(range(1, setup.world_size // nodes + 1)))
    return layout_report(config, plan.counts, setup, nodes, gpu, links, str(config_name) if config_name else None,
                         t.global_batch_size is not None or t.global_batch_tokens is not None, reshard,
                         sequence_parallel_sizes)
