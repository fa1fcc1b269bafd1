"""qwen3_5 (gated-delta hybrid): keep packed examples apart in the linear-attention layers.

How transformers 5.23 dispatches (``models/qwen3_5/modeling_qwen3_5.py``): ``Qwen3_5GatedDeltaNet``
calls the module-level names ``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule``. Each is a
wrapper that, at import time, bound the ``causal_conv1d`` / ``fla`` kernel when that package
imports, and otherwise the pure-torch reference. The layer receives no ``position_ids``, only the
forward kwargs: ``seq_idx`` and ``cu_seq_lens_q`` reach the convolution, and ``cu_seq_lens_q``
reaches the recurrence as ``cu_seqlens`` (with ``seq_idx`` still beside it). With a kernel these
keep examples apart. The torch reference ignores them -- the convolution bleeds
``kernel_size - 1`` tokens into the next example and the recurrent state carries over -- so the
wrapper refuses them with a ValueError instead.

The fix replaces those two module-level names, and only where no kernel was bound, with
dispatchers that run transformers' own torch reference once per example. This has to be module-wide
because the layer looks the functions up by name; it changes nothing but the calls that would
otherwise raise: without boundary kwargs, or with a kernel, the original function runs untouched
with the same kwargs. The cached single-token decode path (``torch_recurrent_gated_delta_rule``)
never sees packed rows and is left alone.

Where fla's kernel is bound, it takes ``cu_seqlens`` only with a batch of one row (``ValueError: The
batch size is expected to be 1 rather than 2 when using cu_seqlens``, ``fla/ops/gated_delta_rule/
chunk.py``), while a packed micro-batch is ``[B, max_length]`` with ``cu_seqlens`` over its B x
max_length tokens flattened (``data/collator.pack_kwargs``). The gated-delta name then gets a
dispatcher that hands the kernel those B rows as one row of B x max_length tokens -- the same
computation, as fla's docstring prescribes -- and gives the output back as B rows. Every other layer
already takes B rows: flash-attention varlen flattens the batch itself for ``cu_seq_lens_q/k``, sdpa
and eager build their block-diagonal masks per row from ``position_ids``, and causal-conv1d reads
``seq_idx`` per row.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from sft_recipes.architectures.kernels import kernel_bound, use_torch_references_where_triton_cannot_run

# Set on our dispatchers so installing twice does not wrap a wrapper.
_SEGMENT_AWARE = "_sft_recipes_segment_aware"


def install_segment_aware_fallbacks(modeling_module: ModuleType) -> None:
    """Make ``modeling_module``'s torch conv and gated-delta paths honour ``seq_idx``/``cu_seqlens``.

    ``modeling_module`` is a transformers modeling module with the qwen3_5 gated-delta layout
    (``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule`` at module level). Where fla is bound,
    its gated-delta kernel gets a batch of packed rows as the one row it accepts. Idempotent.
    """
    # fla's kernels, bound when the module imported, cannot run without a GPU or Triton's interpreter
    use_torch_references_where_triton_cannot_run()
    conv = modeling_module.causal_conv1d_fn
    if not _is_installed(conv) and not kernel_bound(conv):
        modeling_module.causal_conv1d_fn = _segment_aware_conv(conv)
    chunk = modeling_module.torch_chunk_gated_delta_rule
    if not _is_installed(chunk):
        packed = _as_one_row if kernel_bound(chunk) else _per_example
        modeling_module.torch_chunk_gated_delta_rule = _chunk_rule(chunk, packed)


def segment_bounds(
    batch_size: int,
    seq_len: int,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every example in a ``[batch_size, seq_len]`` packed batch.

    Boundaries come from ``seq_idx`` ([B, T], a new example wherever the id changes) or else from
    ``cu_seqlens`` (offsets into the flattened B*T tokens, flash-attention style). Rows always
    separate examples.
    """
    total = batch_size * seq_len
    if seq_idx is not None:
        seq_idx = seq_idx.expand(batch_size, seq_len)
        starts = torch.ones(batch_size, seq_len, dtype=torch.bool, device=seq_idx.device)
        starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
        flat_starts = starts.reshape(-1).nonzero().flatten().tolist()
    else:
        assert cu_seqlens is not None, "segment_bounds needs seq_idx or cu_seqlens"
        offsets = cu_seqlens.tolist()
        if offsets[-1] != total:
            raise ValueError(
                f"cu_seq_lens end at {offsets[-1]} but the batch holds {total} tokens; build them from the "
                "same packed rows (sft_recipes.data.collator.pack_kwargs)."
            )
        flat_starts = sorted(set(offsets[:-1]) | set(range(0, total, seq_len)))
    flat_ends = [*flat_starts[1:], total]
    return [
        (start // seq_len, start % seq_len, start % seq_len + end - start)
        for start, end in zip(flat_starts, flat_ends)
    ]


def _is_installed(function: Callable) -> bool:
    return getattr(function, _SEGMENT_AWARE, False)


def _mark(dispatcher: Callable, original: Callable) -> Callable:
    # __wrapped__ keeps transformers' own function reachable (inspect.unwrap, tests).
    functools.update_wrapper(dispatcher, original)
    setattr(dispatcher, _SEGMENT_AWARE, True)
    return dispatcher


def _eager_under_compile(per_example: Callable) -> Callable:
    """The per-example loop runs eagerly under `torch_compile: true`: the examples' bounds are data (read with
    `nonzero`/`tolist`), and tracing them would specialise a graph on every new set of example lengths -- a
    recompile nearly every step (measured: none after step 2 this way, docs/compile.md). One graph break per call."""
    return torch.compiler.disable(per_example, recursive=True)


def _segment_aware_conv(original: Callable) -> Callable:
    def causal_conv1d_fn(
        hidden_states: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        activation: str | None = None,
        seq_idx: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        cu_seqlens = kwargs.pop("cu_seq_lens_q", None)
        if seq_idx is None and cu_seqlens is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        return per_example(hidden_states, weight, bias, activation, seq_idx, cu_seqlens, **kwargs)

    @_eager_under_compile
    def per_example(hidden_states, weight, bias, activation, seq_idx, cu_seqlens, **kwargs):
        batch_size, channels, seq_len = hidden_states.shape
        pieces = [
            original(hidden_states[row : row + 1, :, start:end], weight, bias, activation=activation, **kwargs)
            for row, start, end in segment_bounds(batch_size, seq_len, seq_idx, cu_seqlens)
        ]
        # Pieces run row after row, so joining them on the time axis gives the rows back to back.
        return torch.cat(pieces, dim=2).reshape(channels, batch_size, seq_len).transpose(0, 1)

    return _mark(causal_conv1d_fn, original)


def _chunk_rule(original: Callable, packed: Callable) -> Callable:
    """transformers' gated-delta call, ``(query, key, value, g=, beta=, initial_state=, output_final_state=, ...,
    cu_seqlens=, seq_idx=)``: without packed boundaries ``original`` runs untouched; with them,
    ``packed(original, query, key, value, g, beta, cu_seqlens, seq_idx, **the rest)``."""

    def torch_chunk_gated_delta_rule(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if seq_idx is None and cu_seqlens is None:
            return original(query, key, value, g=g, beta=beta, **kwargs)
        return packed(original, query, key, value, g, beta, cu_seqlens, seq_idx, **kwargs)

    return _mark(torch_chunk_gated_delta_rule, original)


@_eager_under_compile
def _per_example(original, query, key, value, g, beta, cu_seqlens, seq_idx, **kwargs):
    """The torch reference once per packed example (it ignores boundaries); one final state per example, as fla
    returns them for cu_seqlens."""
    batch_size, seq_len = query.shape[:2]
    bounds = segment_bounds(batch_size, seq_len, seq_idx, cu_seqlens)
    if kwargs.get("initial_state") is not None and len(bounds) > 1:
        raise ValueError(
            "A recurrent state cannot continue into several packed examples at once; run packed rows "
            "without a cache (use_cache=False)."
        )
    outputs, final_states = [], []
    for row, start, end in bounds:
        piece = slice(row, row + 1), slice(start, end)
        output, final_state = original(query[piece], key[piece], value[piece], g=g[piece], beta=beta[piece], **kwargs)
        outputs.append(output)
        final_states.append(final_state)
    output = torch.cat(outputs, dim=1).reshape(batch_size, seq_len, *outputs[0].shape[2:])
    return output, torch.cat(final_states) if kwargs.get("output_final_state") else None


def _as_one_row(kernel, query, key, value, g, beta, cu_seqlens, seq_idx, **kwargs):
    """fla's kernel, which takes cu_seqlens only with one row: B packed rows go in as one row of B x T tokens."""
    batch_size, seq_len = query.shape[:2]
    if cu_seqlens is None or batch_size == 1:
        return kernel(query, key, value, g=g, beta=beta, cu_seqlens=cu_seqlens, seq_idx=seq_idx, **kwargs)
    # cu_seqlens count over the B rows back to back; rows always separate examples (as in segment_bounds),
    # so every row edge is a boundary (our collators include them already).
    row_edges = torch.arange(0, batch_size * seq_len + 1, seq_len, device=cu_seqlens.device)
    cu_seqlens = torch.unique(torch.cat([cu_seqlens, row_edges.to(cu_seqlens.dtype)]))
    query, key, value, g, beta = (x.reshape(1, batch_size * seq_len, *x.shape[2:]) for x in (query, key, value, g, beta))
    output, final_state = kernel(query, key, value, g=g, beta=beta, cu_seqlens=cu_seqlens, seq_idx=seq_idx, **kwargs)
    return output.reshape(batch_size, seq_len, *output.shape[2:]), final_state


# Boundary kwargs of the packed text rows (`data/collator.pack_kwargs`): Qwen3_5Model hands its **kwargs to the
# vision tower too, where flash attention would get cu_seq_lens_q twice (the tower passes its own per image).
_TEXT_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def prepare_for_image_packing(model: torch.nn.Module) -> None:
    """Packed image + text rows on a qwen3_5 VLM: the tower sees only its own boundaries, and runs every step.

    - The text rows' boundary kwargs are taken off the vision tower's call (it keeps each image apart itself,
      through the ``cu_seqlens`` it builds from ``image_grid_thw``).
    - A batch without images (``pixel_values`` empty or absent) encodes one blank 2x2-merge image whose features
      join the output times zero: every rank enters the tower every step, as FSDP2's collectives over its
      shards require, and a trained tower gets its (zero) gradient on every rank. ms-swift and LLaMA-Factory
      feed a dummy image for the same reason under ZeRO-3.
    Idempotent.
    """
    vlm = next(module for module in model.modules() if hasattr(module, "visual") and hasattr(module, "language_model"))
    if getattr(vlm, _SEGMENT_AWARE, False):
        return
    vlm.visual.register_forward_pre_hook(_without_text_packing_kwargs, with_kwargs=True)
    vlm.register_forward_pre_hook(_note_missing_images, with_kwargs=True)
    vlm.register_forward_hook(_blank_image_when_none, with_kwargs=True)
    setattr(vlm, _SEGMENT_AWARE, True)


def _without_text_packing_kwargs(module, args, kwargs):
    return args, {key: value for key, value in kwargs.items() if key not in _TEXT_PACKING_KWARGS}


def _note_missing_images(module, args, kwargs):
    pixel_values = kwargs.get("pixel_values")
    module._sft_recipes_no_images = pixel_values is None or pixel_values.numel() == 0
    if module._sft_recipes_no_images:
        kwargs = {**kwargs, "pixel_values": None, "image_grid_thw": None}
    return args, kwargs


def _blank_image_when_none(module, args, kwargs, output):
    if not module._sft_recipes_no_images:
        return output
    config = module.visual.config
    merge = config.spatial_merge_size
    width = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    grid = torch.tensor([[1, merge, merge]], device=output.last_hidden_state.device)
    pixels = torch.zeros(merge * merge, width, device=grid.device, dtype=module.visual.dtype)
    features = module.visual(pixels, grid_thw=grid).pooler_output
    output.last_hidden_state = output.last_hidden_state + 0.0 * features.sum().to(output.last_hidden_state.dtype)
    return output
