"""Process-wide defaults that must be in place before torch/huggingface_hub read them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

LORA_KEY = "use_peft"


def set_runtime_defaults() -> None:
    """On GPU machines: fast Hub downloads and a fragmentation-resistant CUDA allocator.

    huggingface_hub 2.x downloads through hf-xet (installed from requirements.txt) and no longer
    reads HF_HUB_ENABLE_HF_TRANSFER: hf_transfer is dead weight. It reads its constants at import
    time, and the CUDA allocator reads PYTORCH_ALLOC_CONF at first use, so call this first thing.
    A value the user set always wins.
    """
    import torch

    if torch.cuda.is_available():
        os.environ.setdefault("HF_XET_HIGH_PERFORMANCE", "1")
        # Packed long blocks allocate many differently sized buffers (the Qwen seed sets this too).
        os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")


def may_use_lora(argv: list[str], environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether a `scripts/sft.py` command line can be a LoRA run, from its raw text, before anything is parsed.

    A run is LoRA only through `use_peft`, written in the recipe, in HYPERPARAMETERS_PATH's file or on the
    command line; a source that mentions it at all (even as `false`) counts.
    """
    files = [name for name in argv if name.endswith((".yaml", ".yml"))]  # the recipe, an accelerate config
    sources = [*argv]
    for name in [*files, environ.get("HYPERPARAMETERS_PATH", "")]:
        try:
            sources.append(Path(name).read_text(errors="replace") if name else "")
        except OSError:
            pass  # not a file: the recipe loader says so
    return any(LORA_KEY in text for text in sources)


def without_peft_unless_lora(argv: list[str]) -> bool:
    """Hide PEFT from a run that cannot be a LoRA run (`may_use_lora`); True when hidden.

    transformers' trainer_utils imports peft whenever it is installed (~3.4 s of a rank's ~6 s of imports on
    2 CPU cores, most of it peft's own import of transformers' Bloom model; and torchao's, when installed), for
    a run that never builds an adapter. `sys.modules["peft"] = None` makes `importlib.util.find_spec("peft")`
    None, so transformers and TRL take their no-PEFT paths. Call before anything imports transformers.
    """
    if "peft" in sys.modules:  # imported already (a process that called this before, or the tests' warm launcher)
        return sys.modules["peft"] is None
    if may_use_lora(argv):
        return False
    sys.modules["peft"] = None
    return True
