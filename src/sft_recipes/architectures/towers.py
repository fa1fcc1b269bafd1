"""The parts of a checkpoint: its text decoder, and (a VLM's) vision tower, kept but not trained in text-only SFT.

Text-only batches give the vision tower no gradients, so AdamW never updates it; but an optimizer
that holds its parameters breaks resume (torch.distributed.checkpoint initialises state for every
parameter of the fresh optimizer and then finds none saved for the tower), and its fp32 state
costs memory for nothing. Freezing it trains exactly the same model; the export keeps it unchanged.
Image SFT (`dataset_format: vision_messages`) chooses: `freeze_vision_tower` (default true) keeps the
tower frozen and `train_vision_merger` (default true) still trains its merger; false trains it all.
"""

from __future__ import annotations

import torch

# model_type -> the vision tower's module path in the checkpoint's own class.
VISION_TOWERS = {"qwen3_5": "model.visual"}
# The tower's projector into the text model, inside the tower.
VISION_MERGERS = {"qwen3_5": "merger"}


def text_decoder(model: torch.nn.Module) -> torch.nn.Module | None:
    """The text decoder (the module with ``embed_tokens`` and ``layers``), however deep a VLM nests it; None
    unless there is exactly one."""
    decoders = [module for module in model.modules() if hasattr(module, "embed_tokens") and hasattr(module, "layers")]
    return decoders[0] if len(decoders) == 1 else None


def freeze_vision_tower(model: torch.nn.Module, keep_merger: bool = False) -> int:
    """Freeze the vision tower of a VLM checkpoint (in place), its merger too unless `keep_merger` (image SFT
    trains the projector into the text model); return how many parameters were frozen."""
    path = VISION_TOWERS.get(model.config.model_type)
    if path is None:
        return 0
    tower = model.get_submodule(path)
    tower.requires_grad_(False)
    if keep_merger:
        tower.get_submodule(VISION_MERGERS[model.config.model_type]).requires_grad_(True)
    return sum(parameter.numel() for parameter in tower.parameters() if not parameter.requires_grad)
