"""Which modules FSDP2 shards as units, and proof that LoRA parameters sit in the right ones.

The unit class comes from the model itself (`_no_split_modules`, e.g. `GptOssDecoderLayer`), not
from a list of name guesses; a recipe (`fsdp_wrap_classes`) or the accelerate config may name
others, and a class the model does not have is an error. accelerate's FSDP plugin reads the
classes from `FSDP_TRANSFORMER_CLS_TO_WRAP` when the Trainer creates it (that is how `accelerate
launch` passes `fsdp_transformer_layer_cls_to_wrap`), so the resolved list is pinned there.

LoRA on expert parameters (`target_parameters`) is only safe when its `lora_A`/`lora_B` weights
are sharded *with* the decoder layer around them: peft's `ParamWrapper` reads those weights
without calling their modules, so an FSDP unit of their own is never all-gathered and training
fails in `get_delta_weight` on the sharded shapes (huggingface/peft#3080). FSDP1 with peft's
auto-wrap policy builds exactly that layout; `guard_lora_fsdp_layout` refuses it at the first step.

The output head must share an FSDP unit with a module its forward really calls. accelerate 1.15
(huggingface/accelerate#4015) shards ``[final norm, lm_head]`` as one unit, and looks for the norm
only among the direct children of ``base_model``. A VLM's text decoder sits one level deeper
(``Qwen3_5ForConditionalGeneration.model.language_model.norm``), so there ``lm_head`` became a unit of
its own. TRL's fused LM head reads ``lm_head.weight`` without calling ``lm_head``: the unit was
never gathered, TRL took the sharded weight's ``full_tensor()``, and its backward left each rank's
shard with that rank's own gradient, never reduced across ranks -- a silently wrong lm_head update
on every multi-process Qwen3.5 run (found as SP=2 training unlike one process; step 2 off by 8e-3).
`group_output_head_with_final_norm` makes accelerate find the text decoder's norm wherever it is.
"""

from __future__ import annotations

import functools
import logging
import os

import accelerate.utils.fsdp_utils
import torch
from sft_recipes.architectures.towers import text_decoder
from sft_recipes.errors import RecipeError

logger = logging.getLogger(__name__)

WRAP_CLASSES_ENV = "FSDP_TRANSFORMER_CLS_TO_WRAP"
_LORA_PARAMETER_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.")


def resolve_fsdp_wrap_classes(model: torch.nn.Module, recipe_classes: list[str] | None = None) -> list[str]:
    """The FSDP unit classes: the recipe's, else the accelerate config's, else the model's `_no_split_modules`.

    ValueError naming the model's module classes when a class is not in the model or none is known.
    """
    launcher_classes = [name for name in os.environ.get(WRAP_CLASSES_ENV, "").split(",") if name]
    if recipe_classes:
        classes, source = list(recipe_classes), "the recipe's fsdp_wrap_classes"
    elif launcher_classes:
        classes, source = launcher_classes, "the accelerate config's fsdp_transformer_layer_cls_to_wrap"
    else:
        # transformers 5 keeps a composite model's _no_split_modules as a set: sorted, so every process (and every
        # PYTHONHASHSEED) logs and pins the same order
        classes, source = sorted(getattr(model, "_no_split_modules", None) or []), "the model's _no_split_modules"
    present = sorted({type(module).__name__ for module in model.modules()})
    if not classes:
        raise RecipeError(
            f"{type(model).__name__} declares no _no_split_modules, so FSDP does not know its decoder layer: set "
            f"`fsdp_wrap_classes: [...]` in the recipe to the repeated block class, one of: {', '.join(present)}."
        )
    missing = [name for name in classes if name not in present]
    if missing:
        raise RecipeError(
            f"FSDP wrap class(es) {missing} from {source} are not in {type(model).__name__}; its module classes "
            f"are: {', '.join(present)}. Name the decoder layer class (or drop the setting to use the model's own)."
        )
    return classes


def pin_fsdp_wrap_classes(model: torch.nn.Module, recipe_classes: list[str] | None = None) -> list[str]:
    """Resolve the unit classes and hand them to the FSDP plugin the Trainer is about to create."""
    classes = resolve_fsdp_wrap_classes(model, recipe_classes)
    os.environ[WRAP_CLASSES_ENV] = ",".join(classes)
    return classes


def text_decoder_final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The norm before the output head: the last ``*Norm`` child of the text decoder; None without one."""
    decoder = text_decoder(model)
    if decoder is None:
        return None
    norms = [child for child in decoder.children() if "Norm" in type(child).__name__]
    return norms[-1] if norms else None


def group_output_head_with_final_norm() -> None:
    """Make accelerate's FSDP2 preparation shard the output head with the text decoder's final norm (idempotent).

    Call before the Trainer prepares the model. Upstream's own answer wins where it finds one.
    """
    find = accelerate.utils.fsdp_utils._find_final_norm
    if getattr(find, "_sft_recipes_text_decoder", False):
        return

    @functools.wraps(find)
    def find_final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
        return find(model) or text_decoder_final_norm(model)

    find_final_norm._sft_recipes_text_decoder = True
    accelerate.utils.fsdp_utils._find_final_norm = find_final_norm


def is_lora_parameter(name: str) -> bool:
    return any(part in f".{name}" for part in _LORA_PARAMETER_PARTS)


def lora_fsdp_layout_problems(model: torch.nn.Module, wrap_classes: list[str]) -> list[str]:
    """LoRA parameters whose nearest FSDP unit is not a module of `wrap_classes` (one line each)."""
    from torch.distributed.fsdp import FSDPModule

    units = {name: module for name, module in model.named_modules() if isinstance(module, FSDPModule)}
    problems = []
    for name, _ in model.named_parameters():
        if not is_lora_parameter(name):
            continue
        owner = max((unit for unit in units if unit == "" or name.startswith(unit + ".")), key=len, default=None)
        unit = None if owner is None else _unwrap_checkpoint(units[owner])
        if unit is None or not _is_one_of(unit, wrap_classes):
            where = "no FSDP unit" if owner is None else f"FSDP unit '{owner or '<root>'}' ({type(unit).__name__})"
            problems.append(f"{name} is in {where}")
    return problems


def check_lora_fsdp_layout(model: torch.nn.Module, wrap_classes: list[str]) -> int:
    """Raise RuntimeError unless every LoRA parameter is sharded with its decoder layer; returns how many were checked."""
    problems = lora_fsdp_layout_problems(model, wrap_classes)
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise RuntimeError(
            f"Unsafe FSDP layout for LoRA: {len(problems)} LoRA parameter(s) are not sharded with their "
            f"{'/'.join(wrap_classes)}: {shown}. peft's ParamWrapper (lora_target_parameters) reads lora_A/lora_B "
            "weights without calling their modules, so a unit of their own is never gathered and training breaks "
            "(huggingface/peft#3080). Use FSDP2 with fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP and no extra "
            "wrapping of LoRA modules; fsdp_wrap_classes must name the decoder layer."
        )
    return sum(1 for name, _ in model.named_parameters() if is_lora_parameter(name))


def guard_lora_fsdp_layout(model: torch.nn.Module, wrap_classes: list[str]) -> None:
    """Check the layout once, at the model's first forward: the earliest moment the Trainer has sharded it.

    Attached to the model rather than to a trainer, so the check comes with the model whoever runs it.
    Without FSDP (one process) there is nothing to check.
    """
    from torch.distributed.fsdp import FSDPModule

    def check_once(module, args, kwargs):
        handle.remove()
        if not any(isinstance(submodule, FSDPModule) for submodule in module.modules()):
            return
        checked = check_lora_fsdp_layout(module, wrap_classes)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            logger.info("FSDP layout: all %d LoRA parameters are sharded with their %s", checked, "/".join(wrap_classes))

    handle = model.register_forward_pre_hook(check_once, with_kwargs=True)


def _unwrap_checkpoint(module: torch.nn.Module) -> torch.nn.Module:
    # accelerate's activation checkpointing puts each decoder layer inside a CheckpointWrapper.
    return getattr(module, "_checkpoint_wrapped_module", module)


def _is_one_of(module: torch.nn.Module, class_names: list[str]) -> bool:
    # fully_shard swaps a module's class for a subclass named FSDP<Class>: match along the MRO.
    return any(cls.__name__ in class_names for cls in type(module).__mro__)
