"""Load what a run exported into its output_dir: a consolidated model, or its base + the PEFT adapter.

The scripts that read an output folder (scripts/chat.py, show_run.py, evaluate.py) refuse a wrong one in one
`error:` line that says what the folder is -- not a folder here, a Trainer checkpoint inside a run's output_dir
(`output_dir_refusal`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from sft_recipes.loading import cache_only, model_class_for

ADAPTER_CONFIG = "adapter_config.json"
TRAINER_CHECKPOINT = re.compile(r"checkpoint-\d+")  # the Trainer's checkpoint folders inside an output_dir


def exported_kind(output_dir: str | Path) -> str | None:
    """"adapter" (PEFT adapter_config.json), "full" (config.json), or None: no export there."""
    output_dir = Path(output_dir)
    if (output_dir / ADAPTER_CONFIG).is_file():
        return "adapter"
    if (output_dir / "config.json").is_file():
        return "full"
    return None


def output_dir_refusal(path: str | Path, lacks: str, command: str | None = None) -> str:
    """The one line refusing `path` as a run's output_dir: it is not a folder here, or a Trainer checkpoint (the
    export is in the output_dir above it), or it `lacks` what the script reads ("holds no ..."). `command`
    is the fix with a folder in place of {} (e.g. "make chat OUT={}"); without it the fix is to pass the folder."""
    path = Path(path)
    retry = command.format if command else "pass {}".format
    pass_a_run = f"pass a run's output_dir, e.g. {command.format('outputs/demo')}" if command else (
        "pass the output_dir of a finished run")
    if not path.is_dir():
        return f"{path} is not a folder here: {pass_a_run}"
    if TRAINER_CHECKPOINT.fullmatch(path.name) and (path / "trainer_state.json").is_file():
        run = path.parent
        if exported_kind(run) is not None:
            return (f"{path} is a Trainer checkpoint (what a resume starts from); the run's export is in its "
                    f"output_dir: {retry(run)}")
        return (f"{path} is a Trainer checkpoint (what a resume starts from), and its output_dir {run} holds no export "
                f"yet (the run did not finish): rerun the run's command, which resumes from its last checkpoint, then "
                f"{retry(run)}")
    return f"{path} {lacks}: {pass_a_run}"


def export_kind(output_dir: str | Path, command: str | None = None) -> str:
    """"adapter" (PEFT adapter_config.json), "full" (config.json), or ValueError for anything else (its message
    `output_dir_refusal`'s, with `command` as the fix)."""
    kind = exported_kind(output_dir)
    if kind is None:
        raise ValueError(output_dir_refusal(output_dir, f"holds no exported model (no config.json, no {ADAPTER_CONFIG})",
                                            command))
    return kind


def load_export(output_dir: str | Path, base_model: str | None = None):
    """(model in eval mode, tokenizer) for a run's export. An adapter loads onto `base_model`, by default the
    base its adapter_config.json names."""
    from sft_recipes.lora import load_adapter

    output_dir = Path(output_dir)
    kind = export_kind(output_dir)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    if kind == "adapter":
        base = base_model or json.loads((output_dir / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
        offline = bool(cache_only(base))  # a Hub id where the Hub cannot be asked: the cache, without ~30 s of retries
        config = AutoConfig.from_pretrained(base, local_files_only=offline)
        model = load_adapter(model_class_for(config).from_pretrained(base, local_files_only=offline), output_dir)
    else:
        model = model_class_for(AutoConfig.from_pretrained(output_dir)).from_pretrained(output_dir)
    return model.eval(), tokenizer
