"""Process-wide defaults that must be in place before torch/huggingface_hub read them."""

from __future__ import annotations

import os


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
