"""LoRA from the recipe: every PEFT knob, applied, then checked against what the model really got.

TRL's `ModelConfig` has one rank and one alpha; recipes also say `lora_rank_pattern` and
`lora_alpha_pattern` (e.g. rank 8 on gpt-oss's expert parameters, 32 elsewhere). PEFT applies
them by regex on each target's name, silently falling back to `r` when a key matches nothing,
and (0.21.2) warns that keys for `target_parameters` "did not match" even when they did. So we
do not trust either: after `get_peft_model` we walk the LoRA layers, read the ranks off the
`lora_A`/`lora_B` shapes, and fail on any pattern key that really matched nothing.
"""

from __future__ import annotations

import re
import warnings
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

ADAPTER_NAME = "default"
# What peft 0.21.2 (tuners_utils.BaseTuner.inject_adapter) warns when a rank/alpha pattern key
# matches no *module* name; keys for `target_parameters` name parameters, so it always fires for them.
_FALSE_PATTERN_WARNING = r"The following (rank|alpha)_pattern keys did not match any targeted module"
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class AppliedLora:
    """One LoRA target as it exists in the model."""

    target: str  # e.g. "model.layers.0.mlp.experts.gate_up_proj" (a parameter) or "...self_attn.q_proj"
    rank: int  # per expert for expert parameters
    alpha: float
    num_experts: int  # 1 for a Linear
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]


def check_lora_arguments(model_args) -> None:
    """ValueError for LoRA settings PEFT would refuse late or apply silently wrong."""
    if not model_args.use_peft:
        return
    if model_args.lora_target_parameters and model_args.lora_dropout > 0:
        raise ValueError(
            f"lora_dropout={model_args.lora_dropout} cannot be used with lora_target_parameters "
            f"{model_args.lora_target_parameters}: LoRA on a parameter folds B@A into the weight, so there is no "
            "input to drop out. Set `lora_dropout: 0.0`."
        )
    if not model_args.lora_target_modules and not model_args.lora_target_parameters:
        raise ValueError(
            "use_peft is on but neither lora_target_modules nor lora_target_parameters is set: name what LoRA "
            "adapts, e.g. `lora_target_modules: [all-linear]`."
        )
    for name in ("lora_rank_pattern", "lora_alpha_pattern"):
        pattern = getattr(model_args, name) or {}
        bad = {key: value for key, value in pattern.items() if not isinstance(value, int) or value <= 0}
        if bad:
            raise ValueError(
                f"{name} values must be positive integers, got {bad}; write e.g. `{{mlp.experts.down_proj: 8}}`."
            )


def build_lora_config(model_args):
    """The peft `LoraConfig` the recipe describes (TRL's `get_peft_config` plus the patterns).

    The arguments were checked when they were parsed (`ModelArguments.__post_init__`).
    """
    from peft import LoraConfig

    return LoraConfig(
        task_type=model_args.lora_task_type,
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=model_args.lora_target_modules,
        target_parameters=model_args.lora_target_parameters,
        rank_pattern=dict(model_args.lora_rank_pattern or {}),
        alpha_pattern=dict(model_args.lora_alpha_pattern or {}),
        modules_to_save=model_args.lora_modules_to_save,
        use_rslora=model_args.use_rslora,
        use_dora=model_args.use_dora,
        bias="none",
    )


def apply_lora(model: torch.nn.Module, config, seed: int) -> torch.nn.Module:
    """Wrap `model` with LoRA (`config`: a peft LoraConfig, `build_lora_config`) and check the ranks really
    applied; returns the PeftModel (`describe_lora` is what the run logs of it).

    The adapter initialisation is drawn from `seed` (not from the global RNG), so every rank builds
    the same adapter and a test can rebuild the untrained one.
    """
    from peft import get_peft_model

    see_through_checkpoint_wrappers()
    with without_false_pattern_warning(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config, adapter_name=ADAPTER_NAME)
    check_applied_ranks(applied_lora(peft_model), config)
    return peft_model


def describe_lora(peft_model: torch.nn.Module) -> str:
    """`LoRA applied:` and the table of the ranks really applied, per target."""
    return "LoRA applied:\n" + format_lora_table(applied_lora(peft_model), peft_model)


def load_adapter(base: torch.nn.Module, adapter_dir: str | Path) -> torch.nn.Module:
    """`PeftModel.from_pretrained` (inference mode), with its ranks checked like at training time."""
    from peft import PeftModel

    see_through_checkpoint_wrappers()
    with without_false_pattern_warning():
        model = PeftModel.from_pretrained(base, str(adapter_dir), adapter_name=ADAPTER_NAME)
    check_applied_ranks(applied_lora(model), model.peft_config[ADAPTER_NAME])
    return model


@contextmanager
def without_false_pattern_warning() -> Iterator[None]:
    """Silence peft's claim that rank/alpha pattern keys "did not match": false for target_parameters.

    `check_applied_ranks` replaces it with a check that is exact for modules and parameters alike.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_FALSE_PATTERN_WARNING, category=RuntimeWarning)
        yield


def see_through_checkpoint_wrappers() -> None:
    """Make peft find LoRA weights inside activation-checkpointed layers (idempotent).

    peft 0.21.2 selects adapter weights by module names (`_get_tuner_state_dict_key_prefixes`),
    which under FSDP activation checkpointing contain `_checkpoint_wrapped_module.`, while state
    dict keys do not (the wrapper strips it). Every adapter save then matches nothing and writes an
    EMPTY adapter without error: the Trainer's FSDP checkpoints (so a resume silently restarts the
    LoRA weights from their initialisation) and `save_pretrained`. peft already strips FSDP1's
    `_fsdp_wrapped_module.` the same way; we add the checkpoint wrapper's prefix, keeping the
    original names too so name-based callers (`_mark_only_adapters_as_trainable`) still match.
    """
    from peft.tuners import tuners_utils
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    original = tuners_utils._get_tuner_state_dict_key_prefixes
    if getattr(original, "_sees_checkpoint_wrappers", False):
        return

    def key_prefixes(model, adapter_name=None):
        prefixes = original(model, adapter_name)
        return prefixes | {prefix.replace(_CHECKPOINT_PREFIX, "") for prefix in prefixes}

    key_prefixes._sees_checkpoint_wrappers = True
    tuners_utils._get_tuner_state_dict_key_prefixes = key_prefixes


def applied_lora(model: torch.nn.Module, adapter_name: str = ADAPTER_NAME) -> list[AppliedLora]:
    """Every LoRA target in `model`, with the rank read off its weights (ParamWrapper included)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    found = []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter_name not in module.lora_A:
            continue
        a_shape = tuple(module.lora_A[adapter_name].weight.shape)
        b_shape = tuple(module.lora_B[adapter_name].weight.shape)
        if isinstance(module, ParamWrapper):
            num_experts, target = module.num_experts, f"{name}.{module.parameter_name}"
        else:
            num_experts, target = 1, name
        assert a_shape[0] % num_experts == 0, "peft stacks one rank-r block per expert in lora_A"
        found.append(
            AppliedLora(
                target=base_parameter_path(target),
                rank=a_shape[0] // num_experts,
                alpha=module.lora_alpha[adapter_name],
                num_experts=num_experts,
                a_shape=a_shape,
                b_shape=b_shape,
            )
        )
    return found


def base_parameter_path(peft_name: str) -> str:
    """'base_model.model.model.layers.0.mlp.experts.base_layer.gate_up_proj' -> 'model.layers.0.mlp.experts.gate_up_proj'."""
    name = peft_name.removeprefix("base_model.model.")
    return name.replace(".base_layer", "")


def expected_rank_and_alpha(target: str, config) -> tuple[int, float]:
    """What PEFT should have applied to `target`, by its own matching rule (peft.utils.other.get_pattern_key)."""
    rank_key = _matching_key(config.rank_pattern, target)
    alpha_key = _matching_key(config.alpha_pattern, target)
    rank = config.rank_pattern[rank_key] if rank_key else config.r
    alpha = config.alpha_pattern[alpha_key] if alpha_key else config.lora_alpha
    return rank, alpha


def check_applied_ranks(applied: list[AppliedLora], config) -> None:
    """Raise unless every target has its expected rank/alpha and every pattern key matched a target."""
    if not applied:
        raise ValueError(
            f"LoRA matched nothing: target_modules={config.target_modules}, target_parameters="
            f"{config.target_parameters}. Check the names against `print(model)`."
        )
    wrong = []
    for lora in applied:
        rank, alpha = expected_rank_and_alpha(lora.target, config)
        if (lora.rank, lora.alpha) != (rank, alpha):
            wrong.append(f"{lora.target}: r={lora.rank} alpha={lora.alpha}, expected r={rank} alpha={alpha}")
    assert not wrong, "peft applied other ranks than its own patterns say: " + "; ".join(wrong)
    for attribute, recipe_key in (("rank_pattern", "lora_rank_pattern"), ("alpha_pattern", "lora_alpha_pattern")):
        patterns = getattr(config, attribute) or {}
        unmatched = [key for key in patterns if not any(_matches(key, lora.target) for lora in applied)]
        if unmatched:
            names = sorted({_LAYER_INDEX.sub(".*.", lora.target) for lora in applied})
            raise ValueError(
                f"{recipe_key} key(s) {unmatched} match no LoRA target, so they would be ignored. Keys match the end "
                f"of a target's name; the targets are: {', '.join(names)}."
            )


def format_lora_table(applied: list[AppliedLora], model: torch.nn.Module) -> str:
    """One line per target kind (layer indices folded), plus the trainable share."""
    groups: dict[tuple, list[AppliedLora]] = defaultdict(list)
    for lora in applied:
        groups[(_LAYER_INDEX.sub(".*.", lora.target), lora.rank, lora.alpha, lora.num_experts)].append(lora)
    width = max(len(name) for name, *_ in groups)
    lines = []
    for (name, rank, alpha, experts), members in groups.items():
        per_expert = f" ({experts} experts, A {list(members[0].a_shape)})" if experts > 1 else ""
        lines.append(f"  {name:<{width}}  r={rank:<3} alpha={alpha:<4g} x{len(members)}{per_expert}")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    lines.append(f"  trainable {trainable:,} of {total:,} parameters ({100 * trainable / total:.3f}%)")
    return "\n".join(lines)


def _matches(pattern_key: str, target: str) -> bool:
    return re.match(rf"(.*\.)?({pattern_key})$", target) is not None


def _matching_key(patterns: dict, target: str) -> str | None:
    return next((key for key in patterns if _matches(key, target)), None)
