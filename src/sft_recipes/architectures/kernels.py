"""Which package kernels transformers bound, and whether they can run in this process.

transformers 5.23 (``integrations/hub_kernels.use_kernel_func_from_hub_with_fallback``) binds a
package's kernel -- fla's gated-delta rule for qwen3_5 -- when the package *imports*, not when it
can run. fla-core imports on a machine without a GPU, and its Triton kernels then fail at their
first call (``RuntimeError: 0 active drivers``), even for an unpacked forward. Triton runs them on a
GPU (CUDA, ROCm, Intel XPU), or on CPU through its interpreter (``TRITON_INTERPRET=1``, which the test suite's
kernel tests set: ``tests/triton_interpreter.py``). Anywhere else
`use_torch_references_where_triton_cannot_run` puts transformers' own torch reference back, so a
venv with fla installed trains the CPU twins exactly as one without it.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

# Modeling modules whose module-level functions transformers may have bound to a Triton package (fla).
TRITON_BOUND_FUNCTIONS = {
    "transformers.models.qwen3_5.modeling_qwen3_5": (
        "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
    ),
}
# Set on a reference put back in place of a kernel that cannot run here.
_REFERENCE_ONLY = "_sft_recipes_reference_only"


def triton_runs_here() -> bool:
    """Whether Triton kernels can run in this process: a GPU (CUDA, ROCm, Intel XPU), or Triton's CPU interpreter."""
    return torch.cuda.is_available() or torch.xpu.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def kernel_bound(transformers_function: Callable) -> bool:
    """Whether transformers bound a package kernel behind this module-level function (it decides once, at import)."""
    # Ask transformers' own dispatcher, also when ours (packing, sequence parallelism) are installed in front of
    # it: each keeps the function it wraps as __wrapped__.
    function = transformers_function
    while True:
        if getattr(function, _REFERENCE_ONLY, False):
            return False
        decision = inspect.getclosurevars(function).nonlocals.get("is_new_implementation")
        if decision is not None:
            return decision
        assert hasattr(function, "__wrapped__"), (
            "transformers changed how it binds kernels; revisit sft_recipes.architectures.kernels"
        )
        function = function.__wrapped__


def use_torch_references_where_triton_cannot_run() -> None:
    """Where Triton cannot run, replace the kernels transformers bound (in modeling modules already imported).

    Idempotent; a no-op on a GPU or under the interpreter. Called when a model class is resolved
    (`sft_recipes.loading`) and before the packing fixes wrap qwen3_5's functions (`install_segment_aware_fallbacks`).
    """
    if triton_runs_here():
        return
    for module_name, names in TRITON_BOUND_FUNCTIONS.items():
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name in names:
            function = getattr(module, name)
            if kernel_bound(function):
                setattr(module, name, _torch_reference(function))


def _torch_reference(transformers_function: Callable) -> Callable:
    # functools.wraps on transformers' dispatcher kept the torch function as __wrapped__.
    reference = transformers_function.__wrapped__

    def torch_only(*args: Any, cu_seqlens: Any = None, seq_idx: Any = None, **kwargs: Any) -> Any:
        if cu_seqlens is not None or seq_idx is not None:
            # What transformers' dispatcher does without the package (the packing fixes handle these).
            raise ValueError(
                f"`{reference.__name__}` can't keep packed sequences apart without a kernel that runs here."
            )
        return reference(*args, **kwargs)

    functools.update_wrapper(torch_only, reference)
    setattr(torch_only, _REFERENCE_ONLY, True)
    return torch_only
