"""Mixed precision under FSDP2 as it really runs: the policy every unit got, checked at the first step and logged.

The GPU configs (`mixed_precision: bf16`) make accelerate build `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=bf16)` (its default reduces in the compute dtype) and upcast every trainable parameter to fp32
(`fsdp2_prepare_model`); `sft_recipes.distributed.set_fsdp_reduce_dtype` swaps in the recipe's
`fsdp_reduce_dtype` (fp32 in every shipped recipe). Three places, two libraries: `PrecisionCheck` reads what
`fully_shard` was finally given, on every FSDP unit, and refuses a run that would silently train otherwise --
e.g. a reduce in bf16 where the recipe asked fp32, or master weights left in bf16.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import TrainerCallback

from sft_recipes.errors import RecipeError

logger = logging.getLogger("sft")


def dtype_name(dtype: torch.dtype | None) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", None: "none"}.get(dtype, str(dtype))


@dataclass(frozen=True)
class Precision:
    """What a mixed-precision FSDP2 run computes, reduces and keeps its trainable weights in."""

    compute: torch.dtype  # MixedPrecisionPolicy.param_dtype: the dtype a unit's parameters are all-gathered in
    reduce: torch.dtype  # MixedPrecisionPolicy.reduce_dtype: the gradient reduce-scatter's dtype
    master: torch.dtype  # the sharded trainable parameters (what AdamW updates)

    def describe(self) -> str:
        return (f"{dtype_name(self.compute)} compute, {dtype_name(self.reduce)} gradient reduction, "
                f"{dtype_name(self.master)} master weights")


def expected_precision(training_args) -> Precision | None:
    """The precision the recipe and launch ask for; None without mixed precision (the model's own dtype throughout)."""
    compute = torch.bfloat16 if training_args.bf16 else torch.float16 if training_args.fp16 else None
    if compute is None:
        return None
    return Precision(compute=compute, reduce=getattr(torch, training_args.fsdp_reduce_dtype), master=torch.float32)


def model_precision_problems(model, expected: Precision) -> tuple[list[str], int]:
    """(what differs from `expected` on the `fully_shard`-ed model, the number of FSDP units checked)."""
    from torch.distributed.fsdp import FSDPModule

    problems: list[str] = []
    units = [(name, module) for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    if not units:
        return ["no module of the model is an FSDP2 unit"], 0
    for name, unit in units:
        policy = unit._get_fsdp_state()._mp_policy  # what fully_shard received (torch 2.13: FSDPState._mp_policy)
        if (policy.param_dtype, policy.reduce_dtype) != (expected.compute, expected.reduce):
            problems.append(f"unit {name or '<root>'} has MixedPrecisionPolicy(param_dtype={policy.param_dtype}, "
                            f"reduce_dtype={policy.reduce_dtype})")
    masters = {param.dtype for param in model.parameters() if param.requires_grad}
    if masters != {expected.master}:
        problems.append(f"trainable parameters are {sorted(map(str, masters))}, not {expected.master}")
    return problems, len(units)


class PrecisionCheck(TrainerCallback):
    """At the start of training (the model is sharded by then): refuse a policy other than the one asked for,
    and log the one that runs: `[precision] bf16 compute, fp32 gradient reduction, fp32 master weights (...)`."""

    def __init__(self, expected: Precision) -> None:
        self.expected = expected

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        problems, units = model_precision_problems(model, self.expected)
        if problems:
            raise RecipeError(
                f"the launch asks for {self.expected.describe()} under FSDP2, but {'; '.join(problems[:3])}; "
                "launch with an accelerate config whose mixed_precision matches the recipe's bf16/fp16 and set "
                "fsdp_reduce_dtype in the recipe")
        if args.process_index == 0:
            logger.info("[precision] %s: MixedPrecisionPolicy(param_dtype=%s, reduce_dtype=%s) on all %d FSDP2 units",
                        self.expected.describe(), self.expected.compute, self.expected.reduce, units)
