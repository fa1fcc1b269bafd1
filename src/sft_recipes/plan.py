"""Know before you launch: parameters, FSDP2 memory per GPU, FLOPs and step time from a config alone.

Everything here runs on the CPU in seconds without weights: the model is built on the meta device
from its ``config.json`` (LoRA applied by peft, also on meta), so parameter counts are exact, and
memory and time come from the closed-form model documented on each function. The per-token FLOP
count (`flops_per_token`) is the one function every FLOP and MFU figure of the project uses.

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
- activations see `activation_bytes_per_token`.
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

import json
import math
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from sft_recipes.modeling import TINY_SCHEME, model_class_for
from sft_recipes.models.towers import freeze_vision_tower

if TYPE_CHECKING:
    from peft import LoraConfig

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
# Eager attention implementations whose softmax stays in the compute dtype; the others (llama,
# qwen3, qwen3_5, mixtral, ...) take it in fp32 and cast back, keeping both.
_EAGER_SOFTMAX_IN_COMPUTE_DTYPE = {"gpt_oss"}

LossImplementation = Literal["fused_lm_head", "full_logits"]


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


# --------------------------------------------------------------------------------------------
# Config and meta model


def load_model_config(model_name_or_path: str | Path) -> PretrainedConfig:
    """The model's config from a local directory (``config.json`` alone is enough), a ``.json`` file,
    the Hugging Face cache for a Hub id, or ``tiny:<model_type>`` for a tiny stand-in. Never downloads."""
    if str(model_name_or_path).startswith(TINY_SCHEME):
        from sft_recipes.tiny import tiny_config

        return tiny_config(str(model_name_or_path)[len(TINY_SCHEME) :])
    path = Path(model_name_or_path).expanduser()
    if path.is_file() or path.is_dir():
        if path.is_dir() and not (path / "config.json").is_file():
            raise ValueError(
                f"{path} has no config.json: point model_name_or_path at a model directory or a config file."
            )
        return AutoConfig.from_pretrained(str(path))
    if path.suffix == ".json" or str(model_name_or_path).startswith((".", "/", "~")):
        raise ValueError(f"Model config {path} does not exist: fix model_name_or_path.")
    try:
        return AutoConfig.from_pretrained(str(model_name_or_path), local_files_only=True)
    except OSError as error:
        raise ValueError(
            f"{model_name_or_path} is not in the Hugging Face cache and the planner never downloads: run "
            f"`hf download {model_name_or_path} config.json` or point model_name_or_path at a local directory."
        ) from error


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


def _text_config(config: PretrainedConfig) -> PretrainedConfig:
    return config.get_text_config()


def _num_experts(text_config: PretrainedConfig) -> int:
    return getattr(text_config, "num_local_experts", None) or getattr(text_config, "num_experts", None) or 0


def _is_expert_parameter(name: str) -> bool:
    # gpt_oss "mlp.experts.gate_up_proj", mixtral "experts.0.w1.weight"; not "shared_experts"
    return ".experts." in f".{name}."


def _active_layer_params(layer: torch.nn.Module, text_config: PretrainedConfig) -> float:
    """Parameters one token passes through in this layer: each routed expert is used by top_k of E."""
    experts = _num_experts(text_config)
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
    text_config = _text_config(config)
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


def _layer_types(text_config: PretrainedConfig) -> list[str]:
    return list(getattr(text_config, "layer_types", None) or ["full_attention"] * text_config.num_hidden_layers)


def _head_dim(text_config: PretrainedConfig) -> int:
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
    text_config = _text_config(config)
    q_width = text_config.num_attention_heads * _head_dim(text_config)
    window = getattr(text_config, "sliding_window", None)
    flops = 0.0
    for layer_type in _layer_types(text_config):
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

    def __post_init__(self) -> None:
        for name in ("world_size", "micro_batch_size", "seq_len", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}: fix the recipe.")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {self.mfu}: pass a fraction such as 0.4.")
        if self.loss_implementation not in ("fused_lm_head", "full_logits"):
            raise ValueError(f"loss_implementation {self.loss_implementation!r}: use 'fused_lm_head' or 'full_logits'.")

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch_size * self.seq_len


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class _LayerActivations:
    saved: float  # bytes per token autograd keeps for the layer's backward
    working: float  # bytes per token of gradient temporaries while that backward runs


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
        head_dim = _head_dim(text_config)
        kv = getattr(text_config, "num_key_value_heads", None) or heads
        saved += b * (2 * heads * head_dim + 2 * kv * head_dim) + 4 * heads
        widest = heads * head_dim
        if setup.attn_implementation == "eager":
            # fp32 softmax: its output and the cast kept, fp32 + compute-dtype gradients in backward;
            # compute-dtype softmax (gpt_oss): the probabilities kept, two such gradients in backward
            low_precision = text_config.model_type in _EAGER_SOFTMAX_IN_COMPUTE_DTYPE
            scores_saved = heads * setup.seq_len * (b if low_precision else 4 + b)
            scores_working = heads * setup.seq_len * (2 * b if low_precision else 4 + b)
    experts = _num_experts(text_config)
    if experts:
        expert_intermediate = getattr(text_config, "moe_intermediate_size", None) or text_config.intermediate_size
        top_k = text_config.num_experts_per_tok
        saved += 4 * experts + top_k * b * (2 * h + 4 * expert_intermediate)
        widest = max(widest, top_k * expert_intermediate)
    else:
        saved += 4 * b * text_config.intermediate_size
        widest = max(widest, text_config.intermediate_size)
    return _LayerActivations(saved=saved + scores_saved, working=2 * b * widest + scores_working)


def _model_layer_activations(config: PretrainedConfig, setup: TrainingSetup) -> list[_LayerActivations]:
    text_config = _text_config(config)
    return [_layer_activations(text_config, layer_type, setup) for layer_type in _layer_types(text_config)]


def _held_bytes_per_token(layers: list[_LayerActivations], hidden: int, b: int, checkpointing: bool) -> float:
    """Kept from forward until each layer's backward: every layer's input under checkpointing."""
    return len(layers) * b * hidden if checkpointing else sum(layer.saved for layer in layers)


def activation_bytes_per_token(config: PretrainedConfig, setup: TrainingSetup, checkpointing: bool) -> float:
    """Activation bytes per token of the micro-batch while the largest layer runs its backward.

    With checkpointing every decoder layer keeps only its input (b h) and that layer is recomputed
    (its saved activations plus its gradient working set); without, every layer keeps all it saved.
    """
    layers = _model_layer_activations(config, setup)
    hidden, b = _text_config(config).hidden_size, _bytes(setup.compute_dtype)
    recomputed = max(layer.saved + layer.working for layer in layers)
    if checkpointing:
        return _held_bytes_per_token(layers, hidden, b, True) + recomputed
    return _held_bytes_per_token(layers, hidden, b, False) + max(layer.working for layer in layers)


def _loss_buffer_bytes(config: PretrainedConfig, counts: ParamCounts, setup: TrainingSetup) -> float:
    """Buffers while the loss runs its backward, for one micro-batch of T tokens, vocab V: the final
    norm's activations and the vocabulary buffers.

    full_logits (transformers' ForCausalLMLoss): bf16 logits (b), their fp32 upcast kept as the
    log-softmax output (4), and in backward the fp32 gradient of the log-probabilities and of the
    logits (4 + 4): T V (b + 12). fused_lm_head (TRL 1.16): a 4096-token x 32768-column tile in the
    compute dtype (allocated at full width whatever V is) and fp32 gradient accumulators for the
    hidden states (4 T h) and, when the head trains, for the head weight (4 V h).
    """
    text_config = _text_config(config)
    b = _bytes(setup.compute_dtype)
    tokens, vocab, hidden = setup.tokens_per_micro_batch, text_config.vocab_size, text_config.hidden_size
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
    loss: float
    lora_transient: float
    overhead: float
    total: float
    peak_at: str
    activation_bytes_per_token_checkpointed: float
    activation_bytes_per_token_full: float

    COMPONENTS = (
        "params",
        "grads",
        "optimizer",
        "unsharded_params",
        "reduce_buffers",
        "activations",
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

    ``cuda_context_gib=0`` drops the fixed allowance (a CPU run has no CUDA context or NCCL).
    """
    ws = setup.world_size
    weights_b, compute_b, reduce_b = map(_bytes, (setup.weights_dtype, setup.compute_dtype, setup.reduce_dtype))
    trainable_b = 4 if setup.fp32_master_weights else weights_b
    # FSDP2 casts unsharded gradients to reduce_dtype into a second buffer before reduce-scatter
    gradient_b = compute_b + (reduce_b if reduce_b != compute_b else 0)
    text_config = _text_config(config)
    tokens, hidden = setup.tokens_per_micro_batch, text_config.hidden_size
    checkpointing = setup.activation_checkpointing

    layers = _model_layer_activations(config, setup)
    held = tokens * _held_bytes_per_token(layers, hidden, compute_b, checkpointing)
    per_token = {ckpt: activation_bytes_per_token(config, setup, ckpt) for ckpt in (True, False)}
    # The LM head's unsharded gradient lives from the start of backward until the root reduce-scatter.
    head_grad = compute_b * text_config.vocab_size * hidden if counts.output_head_trainable else 0
    merged = compute_b * counts.lora_targeted_per_layer  # peft ParamWrapper's W + B @ A, one layer
    merged_held = 0 if checkpointing else len(layers) * merged

    moments = {
        "loss backward": {
            "activations": held,
            "loss": _loss_buffer_bytes(config, counts, setup) + head_grad,
            "lora_transient": merged_held,
        },
        "layer backward": {
            "activations": tokens * per_token[checkpointing],
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
    )


def fit_table(memory: MemoryEstimate) -> dict[str, float]:
    """Headroom in GiB per GPU type (negative: does not fit)."""
    return {gpu.name: gpu.memory_gib - memory.total for gpu in GPUS}


# --------------------------------------------------------------------------------------------
# Time


def estimate_step_time(config: PretrainedConfig, counts: ParamCounts, setup: TrainingSetup, gpu: str) -> float:
    """Seconds per optimizer step on ``gpu``: each device trains micro_batch x seq_len x accumulation
    tokens at `flops_per_token`, at ``setup.mfu`` of the GPU's dense bf16 peak."""
    if gpu not in GPU_BY_NAME:
        raise ValueError(f"Unknown GPU {gpu!r}: use one of {sorted(GPU_BY_NAME)}.")
    tokens_per_device = setup.tokens_per_micro_batch * setup.gradient_accumulation_steps
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

    @property
    def sequences_per_step(self) -> int:
        s = self.setup
        return s.micro_batch_size * s.gradient_accumulation_steps * s.world_size

    @property
    def tokens_per_step(self) -> int:
        return self.sequences_per_step * self.setup.seq_len

    @property
    def steps_per_epoch(self) -> int | None:
        if self.setup.dataset_sequences is None:
            return None
        return math.ceil(self.setup.dataset_sequences / self.sequences_per_step)

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
            "sequences_per_step": self.sequences_per_step,
            "tokens_per_step": self.tokens_per_step,
            "steps_per_epoch": self.steps_per_epoch,
            "per_device_memory_gib": {name: memory[name] for name in (*MemoryEstimate.COMPONENTS, "total")},
            "memory_peak_at": self.memory.peak_at,
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
            "setup": setup,
            "counts": counts,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def make_plan(model: PretrainedConfig | str | Path, setup: TrainingSetup, lora: LoraConfig | None = None) -> Plan:
    """Count, estimate memory and time for ``model`` (a config, a local path or a cached Hub id)."""
    config = model if isinstance(model, PretrainedConfig) else load_model_config(model)
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
    )


def _billions(n: float) -> str:
    return f"{n / 1e9:,.3f}B"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def format_plan(plan: Plan) -> str:
    """The plan as a table a person reads before launching: every factor behind every figure."""
    s, c, m = plan.setup, plan.counts, plan.memory
    trainable_dtype = "float32" if s.fp32_master_weights else _dtype_name(s.weights_dtype)
    tokens_per_device = s.tokens_per_micro_batch * s.gradient_accumulation_steps
    head = f"LM head {c.output_head:,}" if c.output_head else "LM head tied"
    loss = {"fused_lm_head": "TRL's chunked LM head, no full logits", "full_logits": "full logits, fp32 loss"}

    def row(label: str, text: str) -> str:
        return f"  {label:<18}{text}"

    lines = [
        f"Plan for {plan.model_type}",
        row("parameters", f"total {c.total:,} ({_billions(c.total)}), trainable {c.trainable:,} "
            f"({100 * c.trainable / c.total:.2f}%)"),
        row("", f"embedding {c.embedding:,}, {head}, {len(c.decoder_layers)} decoder layers, "
            f"largest FSDP unit {c.largest_unit:,}, root {c.root:,}"),
        *(row("LoRA rank", f"{target}: {', '.join(map(str, ranks))}") for target, ranks in c.lora_ranks.items()),
        row("batch", f"{s.micro_batch_size} seq/device x {s.seq_len} tokens x {s.gradient_accumulation_steps} "
            f"accumulation x {s.world_size} devices = {plan.sequences_per_step:,} sequences = "
            f"{plan.tokens_per_step:,} tokens per optimizer step"),
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
            f"{s.attn_implementation} attention"),
        row("loss", f"{s.loss_implementation} ({loss[s.loss_implementation]})"),
        f"  memory per GPU (GiB), at the peak: {m.peak_at}",
        *(f"    {name:<18}{getattr(m, name):>9.2f}" for name in (*MemoryEstimate.COMPONENTS, "total")),
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
