"""Per-architecture fixes for block-diagonal packing, keyed by ``model_type``.

``prepare_for_packing(model)`` applies what an architecture needs so that examples packed in one
row never see each other; ``check_packing_leak(config, attn_implementation)`` proves it on a tiny
random copy of the architecture before training starts. Architectures without an entry (Llama and
most decoders) need nothing beyond the packing kwargs; the preflight still checks them.
``freeze_vision_tower(model)`` keeps a VLM checkpoint's vision tower out of text-only training.
"""

from sft_recipes.architectures.preflight import check_packing_leak
from sft_recipes.architectures.registry import PACKING_QUIRKS, PackingQuirk, prepare_for_packing
from sft_recipes.architectures.towers import freeze_vision_tower

__all__ = ["PACKING_QUIRKS", "PackingQuirk", "check_packing_leak", "freeze_vision_tower", "prepare_for_packing"]
