"""The registry of packing fixes, keyed by ``model_type``; see ``sft_recipes.architectures``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from sft_recipes.architectures import gpt_oss, qwen3_5


@dataclass(frozen=True)
class PackingQuirk:
    """What one architecture needs for packed training, and how to make its leaks visible."""

    prepare: Callable[[torch.nn.Module], None]
    # Re-initialises a random model so that a leak it might have is large: the preflight and the
    # tests use it. Default inits can make a real leak invisible (qwen3_5's fast-decaying gates).
    expose_leaks: Callable[[torch.nn.Module], None] | None = None


# transformers' qwen3_5 modeling module is imported here, for a qwen3_5 model only: where fla is installed, importing
# it imports fla's ~4 s of Triton kernels (every rank of every run paid that when this module imported it).
def _install_qwen3_5_fallbacks(model: torch.nn.Module) -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5

    qwen3_5.install_segment_aware_fallbacks(modeling_qwen3_5)


def _slow_qwen3_5_gates(model: torch.nn.Module) -> None:
    # The recurrent state decays by exp(-exp(A_log) * softplus(a + dt_bias)) per token; near 1,
    # state carried across an example boundary survives to the end of the next example.
    from transformers.models.qwen3_5 import modeling_qwen3_5

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, modeling_qwen3_5.Qwen3_5GatedDeltaNet):
                module.A_log.fill_(-7.0)
                module.dt_bias.fill_(0.0)


_QWEN3_5 = PackingQuirk(prepare=_install_qwen3_5_fallbacks, expose_leaks=_slow_qwen3_5_gates)
PACKING_QUIRKS: dict[str, PackingQuirk] = {
    "qwen3_5": _QWEN3_5,
    "qwen3_5_text": _QWEN3_5,
    "gpt_oss": PackingQuirk(prepare=gpt_oss.install_packed_masks),
}


def prepare_for_packing(model: PreTrainedModel) -> None:
    """Make ``model`` keep packed examples apart (in place); harmless to call twice."""
    # With a KV cache, transformers skips the packed-sequence detection that turns position_ids
    # into block-diagonal masks, so a training forward that forgets use_cache=False would leak.
    model.config.use_cache = False
    model.config.get_text_config().use_cache = False
    quirk = PACKING_QUIRKS.get(model.config.model_type)
    if quirk is not None:
        quirk.prepare(model)

