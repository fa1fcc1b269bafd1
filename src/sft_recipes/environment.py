"""Process-wide defaults that must be in place before torch/huggingface_hub read them, and what library noise to drop."""

from __future__ import annotations

import logging
import os


def _is_torch_enum_register_constant_deprecation(record: logging.LogRecord) -> bool:
    # torch 2.13 deprecates register_constant() on Enum classes; torchao 0.18 still calls it when it is imported
    # (through peft, so in every process that has torchao installed): two warnings a process, nothing to act on.
    return "is an Enum subclass and is now natively supported by torch.compile" not in record.getMessage()


def _is_torchao_cuda_extension_load_failure_on_a_cpu_torch(record: logging.LogRecord) -> bool:
    # torchao loads its CUDA kernels (_C*.so) at import and logs each one that fails, as all do on a CPU torch.
    import torch  # imported already: torchao imports it first

    message = record.getMessage()
    cpu_torch = torch.version.cuda is None and torch.version.hip is None
    return not (cpu_torch and message.startswith("Failed to load ") and "torchao" in message and "_C" in message)


def drop_library_noise() -> None:
    """Two library warnings that say nothing a user can act on, dropped by their exact text (docs/traps.md), so
    that a process's console starts with our own lines. Done when `sft_recipes` is imported, before any entry
    point imports torchao (through peft); adding a filter twice adds it once."""
    logging.getLogger("torch.utils._pytree").addFilter(_is_torch_enum_register_constant_deprecation)
    logging.getLogger("torchao").addFilter(_is_torchao_cuda_extension_load_failure_on_a_cpu_torch)


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
