"""The valid range of every numeric recipe key, checked when the recipe is parsed.

TRL and transformers check few numbers up front: `max_length: 0` used to fail as "no row is left"
(or a gloo reset on the packed path), `learning_rate: nan` inside torch after the model loaded.
Here every int/float field of the recipe dataclasses (ours and TRL's/transformers') has one entry
in `RANGES` -- or in `UNCHECKED`, with the reason -- and tests/test_config.py fails when a new
numeric field appears in neither. A number must also be finite; `None` (where the field allows
it) means "off" or "default" and is never checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    low: float
    high: float | None = None
    low_open: bool = False  # low itself is excluded
    high_open: bool = False
    also: tuple[int, ...] = ()  # sentinel values accepted besides the range, e.g. max_steps: -1
    note: str = ""  # what a value means, when the range alone does not say it

    def admits(self, value: float) -> bool:
        if value in self.also:
            return True
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def describe(self, integer: bool = False) -> str:
        if self.high is not None:
            text = f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        else:
            text = f"{'>' if self.low_open else '>='} {self.low:g}"
        text = f"{'an integer' if integer else 'a finite number'} {text}"
        if self.also:
            text += " or " + " or ".join(str(v) for v in self.also)
        return f"{text} ({self.note})" if self.note else text


AT_LEAST_ONE = Range(1)
POSITIVE = Range(0, low_open=True)
NON_NEGATIVE = Range(0)
SHARE = Range(0, 1)
BELOW_ONE = Range(0, 1, high_open=True)
STEP_INTERVAL = Range(0, low_open=True, note="below 1: a fraction of the total steps")

RANGES: dict[str, Range] = {
    # ours (DataArguments, ModelArguments, TrainingArguments)
    "max_train_samples": AT_LEAST_ONE,
    "max_dropped_share": SHARE,
    "packing_window": Range(1, note="1 packs in arrival order"),
    "lora_rank_pattern": AT_LEAST_ONE,  # each rank in the mapping
    "lora_alpha_pattern": POSITIVE,
    "global_batch_size": AT_LEAST_ONE,
    "global_batch_tokens": AT_LEAST_ONE,
    "max_nonfinite_steps_in_a_row": AT_LEAST_ONE,
    "plan_memory_headroom_gib": Range(0, note="0 offers layouts that fill the GPU"),
    "sequence_parallel_size": Range(1, note="1 turns it off"),
    "sample_max_new_tokens": AT_LEAST_ONE,
    "eval_limit": AT_LEAST_ONE,
    "eval_num_fewshot": Range(0, note="0 scores each prompt alone"),
    "eval_max_gen_toks": AT_LEAST_ONE,
    "min_pixels": Range(1, note="pixels of the smallest resized image; null keeps the checkpoint's"),
    "max_pixels": Range(1, note="pixels of the largest resized image; null keeps the checkpoint's"),
    # TRL's ModelConfig / SFTConfig
    "lora_r": AT_LEAST_ONE,
    "lora_alpha": POSITIVE,
    "lora_dropout": BELOW_ONE,
    "max_length": Range(1, note="tokens per sequence; null for no limit"),
    "pad_to_multiple_of": AT_LEAST_ONE,
    "dataset_num_proc": AT_LEAST_ONE,
    # transformers' TrainingArguments
    "per_device_train_batch_size": AT_LEAST_ONE,
    "per_device_eval_batch_size": AT_LEAST_ONE,
    "gradient_accumulation_steps": AT_LEAST_ONE,
    "eval_accumulation_steps": AT_LEAST_ONE,
    "num_train_epochs": POSITIVE,
    "max_steps": Range(1, also=(-1,), note="-1: train num_train_epochs"),
    "learning_rate": POSITIVE,
    "warmup_steps": Range(0, note="below 1: a fraction of the total steps"),
    "weight_decay": NON_NEGATIVE,
    "adam_beta1": BELOW_ONE,
    "adam_beta2": BELOW_ONE,
    "adam_epsilon": NON_NEGATIVE,
    "max_grad_norm": Range(0, note="0: no clipping"),
    "label_smoothing_factor": BELOW_ONE,
    "neftune_noise_alpha": POSITIVE,
    "router_aux_loss_coef": NON_NEGATIVE,
    "torch_empty_cache_steps": AT_LEAST_ONE,
    "logging_steps": STEP_INTERVAL,
    "eval_steps": STEP_INTERVAL,
    "save_steps": STEP_INTERVAL,
    "eval_delay": NON_NEGATIVE,
    "save_total_limit": AT_LEAST_ONE,
    "seed": Range(0, 2**32 - 1, note="numpy's seed range"),
    "data_seed": Range(0, 2**32 - 1, note="numpy's seed range"),
    "dataloader_num_workers": NON_NEGATIVE,
    "dataloader_prefetch_factor": AT_LEAST_ONE,
    "ddp_bucket_cap_mb": AT_LEAST_ONE,
    "ddp_timeout": Range(1, note="seconds"),
}

# Numeric fields deliberately left unchecked, each with why.
UNCHECKED = {
    "local_rank": "set by the launcher, not by recipes",
    "test_split_size": "checked with the other data-source keys (data/mixture.py check_data_sources)",
    "eval_max_regression": "a score drop, any sign (negative demands a gain); checked with eval_tasks "
                           "(scores/tasks.py check_max_regression)",
}


def range_problems(values: dict[str, Any]) -> list[str]:
    """One message per numeric value outside its key's range (the values already have their field's type)."""
    problems = []
    for key, value in values.items():
        rule = RANGES.get(key)
        if rule is None or value is None:
            continue
        entries = value.items() if isinstance(value, dict) else [(None, value)]
        for part, number in entries:
            if isinstance(number, (int, float)) and not isinstance(number, bool) and not rule.admits(number):
                name = f"{key}[{part!r}]" if part is not None else key
                problems.append(f"'{name}' must be {rule.describe(integer=isinstance(number, int))}, got {number!r}")
    return problems
