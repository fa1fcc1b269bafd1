"""Load what a run exported into its output_dir: a consolidated model, or its base + the PEFT adapter."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from sft_recipes.loading import model_class_for

ADAPTER_CONFIG = "adapter_config.json"


def export_kind(output_dir: str | Path) -> str:
    """"adapter" (PEFT adapter_config.json), "full" (config.json), or ValueError for anything else."""
    output_dir = Path(output_dir)
    if (output_dir / ADAPTER_CONFIG).is_file():
        return "adapter"
    if (output_dir / "config.json").is_file():
        return "full"
    raise ValueError(f"{output_dir} holds no exported model (no config.json, no {ADAPTER_CONFIG}): pass the "
                     "output_dir of a finished run.")


def load_export(output_dir: str | Path, base_model: str | None = None):
    """(model in eval mode, tokenizer) for a run's export. An adapter loads onto `base_model`, by default the
    base its adapter_config.json names."""
    from sft_recipes.lora import load_adapter

    output_dir = Path(output_dir)
    kind = export_kind(output_dir)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    if kind == "adapter":
        base = base_model or json.loads((output_dir / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
        model = load_adapter(model_class_for(AutoConfig.from_pretrained(base)).from_pretrained(base), output_dir)
    else:
        model = model_class_for(AutoConfig.from_pretrained(output_dir)).from_pretrained(output_dir)
    return model.eval(), tokenizer
