"""Ulysses sequence parallelism for packed block-diagonal blocks.

The ``N`` ranks of a sequence-parallel (SP) group share one packed block: each embeds, projects
and runs the MLPs on a contiguous ``1/N`` of its tokens. Around every token-mixing operation an
all-to-all turns the rank's ``[B, L/N, H, D]`` (all heads, its tokens) into ``[B, L, H/N, D]`` (its
heads, the whole block), the operation runs over the whole block with the block's own boundaries,
and the inverse all-to-all brings the result back. Both directions are ``_Exchange``, an autograd
``all_to_all_single`` whose backward is the inverse exchange.

Trap (torch 2.13): ``torch.distributed.nn.functional.all_to_all`` on gloo runs as one ``dist.scatter``
per source with ``src=`` the source's rank *within the group*, where ``scatter`` expects a global rank:
only a group holding ranks 0..N-1 works; any other group fails with ``Global rank 0 is not part of
group`` (or, worse, would name a wrong rank). ``torch.distributed.nn``'s autograd ``all_gather``
backward on gloo goes through that same all-to-all. Its NCCL path calls ``dist.all_to_all`` (and the
all_gather backward ``reduce_scatter``) with ``group=``, right for any group; ours is right for both.

Where it hooks into transformers 5.23 (``models/{llama,qwen3_5,gpt_oss}/modeling_*.py``):

* attention modules call ``ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)``
  with ``[B, H, L/N, D]`` query/key/value after RoPE (so RoPE used the rank's own
  ``position_ids``). The sdpa/flash entries of that registry and each modeling module's
  ``eager_attention_forward`` are replaced by dispatchers that do the exchange for modules this
  function marked and call the original untouched for every other module. gpt_oss's sinks (the
  ``s_aux`` kwarg, ``module.sinks`` in eager) are cut to the rank's heads.
* decoders build their masks from ``position_ids`` and the input length, which under SP are the
  rank's chunk. A forward pre-hook on each text decoder gathers the block's ``position_ids`` and
  hands in masks built by transformers' own builders for the whole block. Flash attention reads
  the block's ``cu_seq_lens_q/k`` and ``max_length_q/k`` from the forward kwargs.
* qwen3_5's gated-delta layers call the module-level ``causal_conv1d_fn`` and
  ``torch_chunk_gated_delta_rule`` (a kernel when installed, else our segment-aware torch paths,
  see ``sft_recipes.architectures.qwen3_5``). Both are wrapped: the convolution exchanges channels (the
  q, k and v channels of the rank's heads), the recurrence exchanges heads; both receive the
  block's ``seq_idx`` / ``cu_seqlens``. The layer's forward marks which layer is running, because
  those functions are not given the module.
* a mixture of experts' load-balancing loss (``load_balancing_loss_func``: mixtral's, which TRL's
  fused LM head calls, and gpt_oss's) is a product of per-expert means over tokens: it gathers
  the router logits of the whole block from the group, so every rank takes it over the block.

KV heads: with ``H`` query and ``K`` kv heads, rank ``r`` takes query heads ``r*H/N ...`` and the
kv heads they read. That is an even split when ``N`` divides ``K``, one replicated kv head per rank
when ``K`` divides ``N`` (each rank's query heads then fall in one kv group); anything else is
refused. Linear-attention heads are split without replication.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.mixtral import modeling_mixtral

from sft_recipes.architectures.registry import prepare_for_packing
from sft_recipes.architectures.towers import text_decoder

# Attention implementations whose masks/boundaries the exchange keeps exact; flash ones read the
# block's cu_seq_lens from the forward kwargs.
FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")
SUPPORTED_IMPLEMENTATIONS = ("eager", "sdpa", *FLASH_IMPLEMENTATIONS)
# The mask each decoder layer type takes; linear-attention layers take none in a packed block.
_MASK_BUILDERS = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
    "linear_attention": None,
}
_SHARD = "_sft_recipes_sequence_parallel"  # attribute on marked modules and on installed dispatchers
_ACTIVE_LINEAR_LAYER: contextvars.ContextVar[_LinearShard | None] = contextvars.ContextVar(
    "sft_recipes_active_linear_layer", default=None
)
# True while a model with sequence parallelism runs as a plain model (every rank the whole input).
_SUSPENDED: contextvars.ContextVar[bool] = contextvars.ContextVar("sft_recipes_sequence_parallel_suspended",
                                                                  default=False)


@contextlib.contextmanager
def sequence_parallel_suspended():
    """Inside, a model given `enable_sequence_parallel` runs as if it had not been: each rank the whole input.

    For forwards outside training, e.g. checking an export against the trained model on a probe.
    """
    token = _SUSPENDED.set(True)
    try:
        yield
    finally:
        _SUSPENDED.reset(token)


# --- groups ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SequenceParallelLayout:
    """Where a rank sits: SP groups are ``sp_size`` consecutive ranks; data parallelism runs across groups."""

    sp_size: int
    sp_rank: int  # position inside the group: which chunk of the block this rank holds
    dp_rank: int  # which group: the data reader this rank shares with its group
    dp_size: int  # number of groups = number of distinct blocks per step


def sequence_parallel_layout(rank: int, world_size: int, sp_size: int) -> SequenceParallelLayout:
    if sp_size < 1 or world_size % sp_size:
        raise ValueError(
            f"sequence_parallel_size={sp_size} must be a positive divisor of the world size {world_size}; "
            f"choose one of {[n for n in range(1, world_size + 1) if world_size % n == 0]}."
        )
    return SequenceParallelLayout(sp_size, rank % sp_size, rank // sp_size, world_size // sp_size)


def new_sequence_parallel_group(sp_size: int) -> tuple[SequenceParallelLayout, dist.ProcessGroup]:
    """This rank's layout and SP process group. Collective: every rank calls it, in the same order."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    layout = sequence_parallel_layout(rank, world_size, sp_size)
    own_group = None
    # new_group must be called by every rank for every group, even groups it is not in.
    for first in range(0, world_size, sp_size):
        group = dist.new_group(list(range(first, first + sp_size)))
        if first == layout.dp_rank * sp_size:
            own_group = group
    return layout, own_group


# --- which heads each rank holds ------------------------------------------------------------------


def supported_sequence_parallel_sizes(num_heads: int, num_kv_heads: int) -> list[int]:
    """SP sizes that split ``num_heads`` query heads exactly, replicating kv heads where needed."""
    return [
        n for n in range(1, num_heads + 1)
        if num_heads % n == 0 and (num_kv_heads % n == 0 or n % num_kv_heads == 0)
    ]


def kv_heads_per_rank(num_heads: int, num_kv_heads: int, sp_size: int, layer: str = "attention") -> list[list[int]]:
    """The kv heads each of the ``sp_size`` ranks needs for its contiguous share of query heads."""
    supported = supported_sequence_parallel_sizes(num_heads, num_kv_heads)
    if sp_size not in supported:
        raise ValueError(
            f"sequence_parallel_size={sp_size} cannot split {layer} with {num_heads} query / {num_kv_heads} kv "
            f"heads: it must divide the query heads and either divide the kv heads or be a multiple of them. "
            f"Sizes that work: {supported}."
        )
    heads_per_rank, group_size = num_heads // sp_size, num_heads // num_kv_heads
    return [
        sorted({head // group_size for head in range(rank * heads_per_rank, (rank + 1) * heads_per_rank)})
        for rank in range(sp_size)
    ]


def sequence_parallel_sizes_for(text_config: Any) -> list[int]:
    """Every SP size that splits all token-mixing layers of ``text_config`` (its text config)."""
    layer_types = set(getattr(text_config, "layer_types", None) or ["full_attention"])
    working: set[int] | None = None
    if layer_types - {"linear_attention"}:
        working = set(supported_sequence_parallel_sizes(text_config.num_attention_heads, text_config.num_key_value_heads))
    if "linear_attention" in layer_types:
        k_heads, v_heads = text_config.linear_num_key_heads, text_config.linear_num_value_heads
        linear = {n for n in range(1, v_heads + 1) if k_heads % n == 0 and v_heads % n == 0}
        working = linear if working is None else working & linear
    return sorted(working)


def check_sequence_parallel_size(text_config: Any, sp_size: int) -> None:
    """Refuse ``sp_size`` unless every token-mixing layer of ``text_config`` splits across it."""
    working = sequence_parallel_sizes_for(text_config)
    if sp_size in working:
        return
    layer_types = set(getattr(text_config, "layer_types", None) or ["full_attention"])
    shapes = []
    if layer_types - {"linear_attention"}:
        shapes.append(
            f"attention {text_config.num_attention_heads} query / {text_config.num_key_value_heads} kv heads"
        )
    if "linear_attention" in layer_types:
        shapes.append(
            f"linear attention {text_config.linear_num_key_heads} k / {text_config.linear_num_value_heads} v heads"
        )
    raise ValueError(
        f"sequence_parallel_size={sp_size} does not split this model ({'; '.join(shapes)}) across a "
        "sequence-parallel group: attention needs a size that divides the query heads and divides or is a "
        "multiple of the kv heads; linear attention one that divides both its k and v heads. "
        f"Sizes that work: {working}."
    )


# --- the exchange ---------------------------------------------------------------------------------


class _Exchange(torch.autograd.Function):
    """Rank ``r`` of ``group`` sends ``pieces[j]`` to rank ``j`` and returns what each rank sent it, in rank order.

    Pieces are of one shape. The backward is the same exchange of the gradients, back to where each
    piece came from. ``all_to_all_single`` with ``group=`` is right for any subgroup on gloo and NCCL.
    """

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, *pieces: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        return _exchange(torch.stack(pieces), group)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[Any, ...]:
        return (None, *_exchange(torch.stack(grads), ctx.group))


def _exchange(stacked: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, ...]:
    assert stacked.shape[0] == dist.get_world_size(group), "one piece per rank of the group"
    received = torch.empty_like(stacked)
    dist.all_to_all_single(received, stacked.contiguous(), group=group)
    return received.unbind(0)


def exchange(pieces: list[torch.Tensor], group: dist.ProcessGroup) -> tuple[torch.Tensor, ...]:
    """Autograd all-to-all over ``group``: piece ``j`` to rank ``j``; what rank ``j`` sent comes back at ``j``."""
    return _Exchange.apply(group, *pieces)


class _GatherChunks(torch.autograd.Function):
    """Every rank's ``chunk`` of ``group``, in rank order; the backward sums each chunk's gradients from every rank."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, chunk: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        gathered = [torch.empty_like(chunk) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, chunk.contiguous(), group=group)
        return tuple(gathered)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[Any, ...]:
        # Rank j's gradient for my chunk arrives at position j: a reduce-scatter gloo lacks, as an exchange.
        return None, torch.stack(_exchange(torch.stack(grads), ctx.group)).sum(0)


def gather_chunks(chunk: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, ...]:
    return _GatherChunks.apply(group, chunk)


def seq_to_heads(
    x: torch.Tensor, group: dist.ProcessGroup, seq_dim: int, head_dim: int, heads_per_rank: list[list[int]]
) -> torch.Tensor:
    """The rank's token chunk of all heads -> the whole block of its heads (``heads_per_rank[rank]``)."""
    index = [torch.tensor(heads, device=x.device) for heads in heads_per_rank]
    incoming = exchange([x.index_select(head_dim, heads) for heads in index], group)
    # Source ranks hold consecutive chunks, so stacking what they sent gives the block in order.
    return torch.cat(incoming, dim=seq_dim)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, seq_dim: int, head_dim: int) -> torch.Tensor:
    """The whole block of the rank's heads -> the rank's token chunk of every rank's heads, in rank order."""
    incoming = exchange(list(x.chunk(dist.get_world_size(group), dim=seq_dim)), group)
    return torch.cat(incoming, dim=head_dim)


def _even_split(count: int, sp_size: int) -> list[list[int]]:
    per_rank = count // sp_size
    return [list(range(rank * per_rank, (rank + 1) * per_rank)) for rank in range(sp_size)]


# --- attention ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _AttentionShard:
    group: dist.ProcessGroup
    q_heads_per_rank: list[list[int]]
    kv_heads_per_rank: list[list[int]]
    rank: int

    @property
    def q_heads(self) -> slice:
        heads = self.q_heads_per_rank[self.rank]
        return slice(heads[0], heads[-1] + 1)


class _HeadShardView:
    """The attention module as the rank's share of heads sees it (kv group size, sinks); all else delegates.

    Attention functions read ``num_key_value_groups`` (to repeat kv heads) and gpt_oss's eager one
    ``sinks`` from the module; with replicated kv heads and cut sinks both differ from the module's.
    """

    def __init__(self, module: torch.nn.Module, **overrides: Any) -> None:
        self._module = module
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _sequence_parallel_attention(attention: Callable, implementation: str) -> Callable:
    def attention_forward(module, query, key, value, attention_mask, **kwargs):
        shard: _AttentionShard | None = None if _SUSPENDED.get() else getattr(module, _SHARD, None)
        if shard is None:
            return attention(module, query, key, value, attention_mask, **kwargs)
        if implementation in FLASH_IMPLEMENTATIONS and kwargs.get("cu_seq_lens_q") is None:
            raise ValueError(
                "Sequence-parallel flash attention needs the block's cu_seq_lens_q/k and max_length_q/k in the "
                "forward kwargs (sft_recipes.data.sequence_shards.shard_block keeps them)."
            )
        # [B, heads, L/N, D] -> [B, heads/N, L, D]; the local position_ids no longer describe these tokens.
        kwargs.pop("position_ids", None)
        query = seq_to_heads(query, shard.group, seq_dim=2, head_dim=1, heads_per_rank=shard.q_heads_per_rank)
        key, value = (
            seq_to_heads(x, shard.group, seq_dim=2, head_dim=1, heads_per_rank=shard.kv_heads_per_rank)
            for x in (key, value)
        )
        overrides = {"num_key_value_groups": query.shape[1] // key.shape[1]}
        if getattr(module, "sinks", None) is not None:
            overrides["sinks"] = module.sinks[shard.q_heads]
        if kwargs.get("s_aux") is not None:
            kwargs["s_aux"] = kwargs["s_aux"][shard.q_heads]
        output, weights = attention(_HeadShardView(module, **overrides), query, key, value, attention_mask, **kwargs)
        # Attention functions return [B, L, heads/N, D].
        return heads_to_seq(output, shard.group, seq_dim=1, head_dim=2), weights

    return _marked(attention_forward, attention)


def _marked(dispatcher: Callable, original: Callable) -> Callable:
    functools.update_wrapper(dispatcher, original)
    setattr(dispatcher, _SHARD, True)
    return dispatcher


def _install_attention_dispatchers(modeling_module: Any) -> None:
    for name in ("sdpa", *FLASH_IMPLEMENTATIONS):
        if name in ALL_ATTENTION_FUNCTIONS and not getattr(ALL_ATTENTION_FUNCTIONS[name], _SHARD, False):
            ALL_ATTENTION_FUNCTIONS.register(name, _sequence_parallel_attention(ALL_ATTENTION_FUNCTIONS[name], name))
    # Eager attention is each modeling module's own function (gpt_oss's adds the sinks), looked up by name.
    if not getattr(modeling_module.eager_attention_forward, _SHARD, False):
        modeling_module.eager_attention_forward = _sequence_parallel_attention(
            modeling_module.eager_attention_forward, "eager"
        )


# --- qwen3_5 gated-delta layers -------------------------------------------------------------------


@dataclass(frozen=True)
class _LinearShard:
    group: dist.ProcessGroup
    k_heads_per_rank: list[list[int]]
    v_heads_per_rank: list[list[int]]
    conv_channels_per_rank: list[list[int]]  # the q, k and v channels of each rank's heads
    conv_channel_order: torch.Tensor  # puts the channels back in place after the return exchange
    rank: int


def _linear_shard(layer: torch.nn.Module, group: dist.ProcessGroup) -> _LinearShard:
    sp_size = dist.get_world_size(group)
    k_heads, v_heads = _even_split(layer.num_k_heads, sp_size), _even_split(layer.num_v_heads, sp_size)

    def channels(heads: list[int], head_size: int, offset: int) -> list[int]:
        return [offset + head * head_size + i for head in heads for i in range(head_size)]

    conv_channels = [
        channels(k, layer.head_k_dim, 0) + channels(k, layer.head_k_dim, layer.key_dim)
        + channels(v, layer.head_v_dim, 2 * layer.key_dim)
        for k, v in zip(k_heads, v_heads)
    ]
    order = torch.argsort(torch.tensor([c for rank_channels in conv_channels for c in rank_channels]))
    return _LinearShard(group, k_heads, v_heads, conv_channels, order, dist.get_rank(group))


def _sequence_parallel_conv(conv: Callable) -> Callable:
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        shard = _ACTIVE_LINEAR_LAYER.get()
        if shard is None:
            return conv(hidden_states, weight, bias, activation=activation, **kwargs)
        # [B, channels, L/N] -> [B, the rank's channels, L]: a depthwise conv needs nothing else.
        mine = torch.tensor(shard.conv_channels_per_rank[shard.rank], device=weight.device)
        hidden_states = seq_to_heads(hidden_states, shard.group, 2, 1, shard.conv_channels_per_rank)
        bias = None if bias is None else bias[mine]
        output = conv(hidden_states, weight[mine], bias, activation=activation, **kwargs)
        output = heads_to_seq(output, shard.group, seq_dim=2, head_dim=1)
        return output.index_select(1, shard.conv_channel_order.to(output.device))

    return _marked(causal_conv1d_fn, conv)


def _sequence_parallel_chunk_rule(rule: Callable) -> Callable:
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                                     **kwargs):
        shard = _ACTIVE_LINEAR_LAYER.get()
        if shard is None:
            return rule(query, key, value, g=g, beta=beta, initial_state=initial_state,
                        output_final_state=output_final_state, **kwargs)
        if initial_state is not None or output_final_state:
            raise ValueError("Sequence parallelism is for training: run the model without a cache (use_cache=False).")
        # [B, L/N, heads(, D)] -> [B, L, heads/N(, D)].
        query, key = (seq_to_heads(x, shard.group, 1, 2, shard.k_heads_per_rank) for x in (query, key))
        value, g, beta = (seq_to_heads(x, shard.group, 1, 2, shard.v_heads_per_rank) for x in (value, g, beta))
        output, _ = rule(query, key, value, g=g, beta=beta, **kwargs)
        return heads_to_seq(output, shard.group, seq_dim=1, head_dim=2), None

    return _marked(torch_chunk_gated_delta_rule, rule)


def _install_linear_dispatchers() -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5  # imported already: the model has its layers

    if not getattr(modeling_qwen3_5.causal_conv1d_fn, _SHARD, False):
        modeling_qwen3_5.causal_conv1d_fn = _sequence_parallel_conv(modeling_qwen3_5.causal_conv1d_fn)
    if not getattr(modeling_qwen3_5.torch_chunk_gated_delta_rule, _SHARD, False):
        modeling_qwen3_5.torch_chunk_gated_delta_rule = _sequence_parallel_chunk_rule(
            modeling_qwen3_5.torch_chunk_gated_delta_rule
        )


def _mark_linear_layer(layer: torch.nn.Module, shard: _LinearShard) -> None:
    forward = layer.forward

    @functools.wraps(forward)
    def sequence_parallel_forward(*args: Any, **kwargs: Any) -> Any:
        token = _ACTIVE_LINEAR_LAYER.set(None if _SUSPENDED.get() else shard)
        try:
            return forward(*args, **kwargs)
        finally:
            _ACTIVE_LINEAR_LAYER.reset(token)

    layer.forward = sequence_parallel_forward


# --- MoE load balancing ----------------------------------------------------------------------------


def _sequence_parallel_load_balancing(balance: Callable, group: dist.ProcessGroup) -> Callable:
    def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        if _SUSPENDED.get() or not isinstance(gate_logits, tuple):
            return balance(gate_logits, num_experts, top_k, attention_mask)
        if attention_mask is not None:
            raise ValueError("Sequence parallelism balances experts over packed blocks: pass no attention_mask.")
        # The balance is a product of per-expert means over the block's tokens, not a sum over chunks: every
        # rank takes it over the whole block. The gather's backward sums the ranks' gradients into each chunk.
        gate_logits = tuple(torch.cat(gather_chunks(layer, group), dim=0) for layer in gate_logits)
        return balance(gate_logits, num_experts, top_k, None)

    return _marked(load_balancing_loss_func, balance)


def _install_load_balancing_dispatchers(group: dist.ProcessGroup) -> None:
    # TRL's fused LM head imports mixtral's at each call; gpt_oss's own forward calls its copy.
    for modeling_module in (modeling_mixtral, modeling_gpt_oss):
        if not getattr(modeling_module.load_balancing_loss_func, _SHARD, False):
            modeling_module.load_balancing_loss_func = _sequence_parallel_load_balancing(
                modeling_module.load_balancing_loss_func, group
            )


# --- masks for the whole block --------------------------------------------------------------------


def _block_masks(decoder: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    if _SUSPENDED.get():
        return None
    position_ids = kwargs.get("position_ids")
    if args or position_ids is None or kwargs.get("past_key_values") is not None:
        raise ValueError(
            "A sequence-parallel decoder takes its inputs as keywords, with the rank's position_ids and no cache."
        )
    if kwargs.get("attention_mask") is not None:
        raise ValueError(
            "Sequence parallelism builds the block's masks from position_ids; pass packed blocks without an "
            "attention_mask."
        )
    group = getattr(decoder, _SHARD)
    # qwen3_5 may carry [4, B, L] positions whose first row is the text one.
    text_positions = position_ids[0] if position_ids.ndim == 3 else position_ids
    gathered = [torch.empty_like(text_positions) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, text_positions.contiguous(), group=group)
    block_positions = torch.cat(gathered, dim=-1)
    # The mask builders read only batch size, length, dtype and device from the embeddings.
    embeds = torch.empty((*block_positions.shape, 0), dtype=decoder.embed_tokens.weight.dtype,
                         device=block_positions.device)
    mask_kwargs = dict(config=decoder.config, inputs_embeds=embeds, attention_mask=None, past_key_values=None,
                       position_ids=block_positions)
    layer_types = getattr(decoder.config, "layer_types", None)
    if layer_types is None:
        masks = create_causal_mask(**mask_kwargs)
    else:
        masks = {kind: _block_mask(kind, mask_kwargs) for kind in set(layer_types)}
    return args, {**kwargs, "attention_mask": masks}


def _block_mask(layer_type: str, mask_kwargs: dict[str, Any]) -> torch.Tensor | None:
    builder = _MASK_BUILDERS[layer_type]
    return None if builder is None else builder(**mask_kwargs)


# --- installing it --------------------------------------------------------------------------------


def enable_sequence_parallel(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Make ``model`` run one packed block across the ranks of ``group``, each holding a contiguous chunk.

    Call on every rank of the group, before FSDP wrapping (idempotent); the model then takes
    ``sft_recipes.data.sequence_shards.shard_block`` batches. Also prepares it for packing.
    """
    prepare_for_packing(model)
    sp_size, rank = dist.get_world_size(group), dist.get_rank(group)
    text_config = model.config.get_text_config()
    implementation = text_config._attn_implementation
    if implementation not in SUPPORTED_IMPLEMENTATIONS:
        raise ValueError(
            f"Sequence parallelism supports attn_implementation {', '.join(SUPPORTED_IMPLEMENTATIONS)}, "
            f"not {implementation!r}."
        )
    check_sequence_parallel_size(text_config, sp_size)
    decoder = text_decoder(model)
    assert decoder is not None, "a causal LM has exactly one text decoder"
    if getattr(decoder, _SHARD, None) is not None:
        return
    setattr(decoder, _SHARD, group)
    # Ahead of gpt_oss's own mask hook, which then sees the masks given and stands aside.
    decoder.register_forward_pre_hook(_block_masks, with_kwargs=True, prepend=True)
    if getattr(text_config, "output_router_logits", None) is not None:  # a mixture of experts
        _install_load_balancing_dispatchers(group)
    # Only a qwen3_5 model has imported transformers' qwen3_5 modeling module (it imports fla where installed)
    gated_delta_net = getattr(sys.modules.get("transformers.models.qwen3_5.modeling_qwen3_5"), "Qwen3_5GatedDeltaNet", ())
    for module in decoder.layers.modules():
        if isinstance(module, gated_delta_net):
            _install_linear_dispatchers()
            _mark_linear_layer(module, _linear_shard(module, group))
        elif hasattr(module, "num_key_value_groups") and hasattr(module, "q_proj"):
            _install_attention_dispatchers(sys.modules[type(module).__module__])
            heads, kv_heads = module.config.num_attention_heads, module.config.num_key_value_heads
            shard = _AttentionShard(
                group, _even_split(heads, sp_size), kv_heads_per_rank(heads, kv_heads, sp_size), rank
            )
            setattr(module, _SHARD, shard)

