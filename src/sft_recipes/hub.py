"""Hub download settings that must be in place before huggingface_hub is first imported."""

from __future__ import annotations

import os


def enable_fast_downloads() -> None:
    """On GPU machines, download with hf-xet's high-performance mode unless the user said otherwise.

    huggingface_hub 2.x downloads through hf-xet (installed from requirements.txt) and no longer
    reads HF_HUB_ENABLE_HF_TRANSFER: hf_transfer is dead weight. huggingface_hub reads its
    constants at import time, so call this before importing transformers, trl or datasets.
    """
    import torch

    if torch.cuda.is_available():
        os.environ.setdefault("HF_XET_HIGH_PERFORMANCE", "1")
