"""Run fla's real Triton kernels on CPU through Triton's interpreter (test-only).

Import this module first, in a fresh interpreter: transformers binds fla's ``chunk_gated_delta_rule``
when its qwen3_5 modeling module imports, and Triton reads ``TRITON_INTERPRET`` when it compiles a
kernel. ``tests/kernel_checks.py`` is run that way, in a subprocess, by ``tests/test_kernels_interpreter.py``.
Everywhere else in the suite no GPU and no interpreter means fla is not used
(``sft_recipes.architectures.kernels``), even though it is installed.

Two shims, both needed by triton 3.9.0 + fla-core 0.6.0 on CPU:

* Triton's autotuner benchmarks each config on a GPU driver: we take the first config
  (``Autotuner.prune_configs`` keeps one, and one config is never benchmarked). Autotuning only picks
  the fastest config; every config computes the same result.
* fla kernels call ``.to(tl.int64)`` on a ``range()`` loop index (``fla/ops/common/chunk_delta_h.py``),
  which compiled Triton makes a tensor but the interpreter leaves a Python int. Kernels run with a
  ``range`` that yields ``tl.full((), i, tl.int32)``, as compiled Triton types the index; only the
  kernels' own globals get it (a copy of their module's), never the host code around them.
"""

from __future__ import annotations

import builtins
import os
import sys

assert "triton" not in sys.modules and "transformers.models.qwen3_5.modeling_qwen3_5" not in sys.modules, (
    "import tests/triton_interpreter.py before triton and transformers' qwen3_5 modeling module"
)
os.environ["TRITON_INTERPRET"] = "1"

import triton.language as tl  # noqa: E402
from triton.runtime import autotuner, interpreter  # noqa: E402


def _tensor_range(*args):
    for index in builtins.range(*(int(arg) for arg in args)):
        yield tl.full((), index, tl.int32)


def _first_config_only(prune_configs):
    def prune(self, kwargs):
        return prune_configs(self, kwargs)[:1]

    return prune


def _compile_and_exec(self, transformed_ast):
    # Triton's own FunctionRewriter._compile_and_exec, with a copy of the kernel's globals that has our range.
    code = compile(transformed_ast, filename=self.filename, mode="exec")
    namespace = {**self.kwargs}
    kernel_globals = {**vars(interpreter), **self.fn.__globals__, "range": _tensor_range}
    exec(code, kernel_globals, namespace)
    return namespace[self.fn.__name__]


def install():
    """Apply the shims, import qwen3_5's modeling module (fla bound) and return it."""
    if not getattr(autotuner.Autotuner.prune_configs, "_first_config_only", False):
        autotuner.Autotuner.prune_configs = _first_config_only(autotuner.Autotuner.prune_configs)
        autotuner.Autotuner.prune_configs._first_config_only = True
        interpreter.FunctionRewriter._compile_and_exec = _compile_and_exec
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from sft_recipes.architectures.kernels import kernel_bound, triton_runs_here

    assert triton_runs_here() and kernel_bound(modeling_qwen3_5.torch_chunk_gated_delta_rule), "fla is not bound"
    return modeling_qwen3_5
