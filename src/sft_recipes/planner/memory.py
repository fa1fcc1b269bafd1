"""The planner's memory model: peak memory per GPU of a `TrainingSetup`, from the exact parameter
counts (`model_math.count_parameters`) and the model's config, in closed form, on the CPU.

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
              every tensor it trades (see `exchange_bytes_per_token`).
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

from dataclasses import dataclass

from transformers import PretrainedConfig

from sft_recipes.planner.model_math import GPUS, ParamCounts, head_dim, layer_types, num_experts, text_config_of
from sft_recipes.planner.setup import TrainingSetup, dtype_bytes

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
    b = dtype_bytes(setup.compute_dtype)
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
                             exchange=exchange_bytes_per_token(text_config, layer_type, setup))


def _kv_heads_per_rank(kv_heads: int, sp: int) -> int:
    """kv heads one rank attends with: an even share, or one replicated head when sp exceeds them."""
    return max(kv_heads // sp, 1)


def exchange_bytes_per_token(text_config: PretrainedConfig, layer_type: str, setup: TrainingSetup) -> float:
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
    b = dtype_bytes(setup.compute_dtype)
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
    hidden, b = text_config_of(config).hidden_size, dtype_bytes(setup.compute_dtype)
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
    b = dtype_bytes(setup.compute_dtype)
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
    weights_b, compute_b, reduce_b = map(dtype_bytes, (setup.weights_dtype, setup.compute_dtype, setup.reduce_dtype))
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
    b = dtype_bytes(setup.compute_dtype)
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
