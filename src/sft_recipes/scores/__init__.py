"""Benchmark scores with EleutherAI's lm-evaluation-harness: which tasks (tasks.py), scoring a loaded model with a
cache (harness.py), base against tuned with the gate, tables and picture (compare.py). docs/evaluation.md."""

from __future__ import annotations

import os
import sys
from types import ModuleType

# What lm-eval's package __init__ sets in os.environ when first imported (lm-eval 0.4.13).
LM_EVAL_ENVIRONMENT = ("HF_XET_HIGH_PERFORMANCE", "HF_HUB_ENABLE_HF_TRANSFER")


def import_lm_eval() -> ModuleType:
    """lm-eval, imported without the download settings its __init__ writes into os.environ: an import must not
    change what this process's later children inherit (a launch, the tests' warm launcher) or how a CPU machine's
    cores are spent on downloads. Call it before any `from lm_eval... import`."""
    if "lm_eval" not in sys.modules:
        before = {name: os.environ.get(name) for name in LM_EVAL_ENVIRONMENT}
        import lm_eval  # noqa: F401

        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return sys.modules["lm_eval"]
