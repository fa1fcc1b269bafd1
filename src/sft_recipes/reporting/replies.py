"""A model's reply as chat and samples show it: without an empty thinking block, and without a line per kernel.

- Qwen3.5's template renders every non-reasoning assistant turn with an empty `<think>\n\n</think>\n\n` (its
  non-thinking form), and its default generation prompt leaves thinking on, so a model tuned on such rows
  starts each reply with that empty block. `<think>` and `</think>` are not special tokens, so
  `skip_special_tokens` keeps them. A block with reasoning inside is kept: it is the model's.
- transformers says, once per kernel, that a missing GPU kernel package (`causal_conv1d`,
  `flash-linear-attention`) falls back to its reference PyTorch implementation: four lines before every Qwen3.5
  answer on CPU. One line per missing package says it instead, naming it (a CPU machine may have fla installed).
  fla itself, installed on a machine without a GPU, warns at import that it runs on CPU (`FLA_ON_CPU`): rank 0
  says it, the other ranks do not.
"""

from __future__ import annotations

import logging
import re
import sys

from transformers import TextStreamer

EMPTY_THINKING = re.compile(r"^\s*<think>\s*</think>\s*")
KERNEL_FALLBACK = "is falling back to its reference PyTorch implementation"
KERNELS_LOGGER = "transformers.integrations.hub_kernels"
FLA_ON_CPU = "Triton is not supported on current platform"  # fla.utils.hardware's UserWarning at import
MISSING_PACKAGE = re.compile(r"because `([^`]+)` is not installed")


def shown_reply(text: str) -> str:
    """The reply without a leading empty thinking block."""
    return EMPTY_THINKING.sub("", text, count=1)


class ReplyStreamer(TextStreamer):
    """TextStreamer that holds a reply's start back while it may still be an empty thinking block, then prints the
    reply as `shown_reply` gives it; the rest streams as it comes."""

    def __init__(self, tokenizer, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self._held: str | None = ""  # None once the start is decided

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if self._held is None:
            return super().on_finalized_text(text, stream_end)
        self._held += text
        start = self._held.lstrip()
        undecided = "<think>".startswith(start) or (start.startswith("<think>") and "</think>" not in start)
        if undecided and not stream_end:
            return None
        held, self._held = shown_reply(self._held), None
        return super().on_finalized_text(held, stream_end)


class _OneLinePerKernelPackage(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        package = MISSING_PACKAGE.search(record.getMessage()) if KERNEL_FALLBACK in record.getMessage() else None
        if package is None:
            return True
        if package[1] not in self.said:
            self.said.add(package[1])
            print(f"[kernels] {package[1]} is not installed (GPU kernels): their reference PyTorch implementations "
                  "run (correct, slower)", file=sys.stderr, flush=True)
        return False


def one_kernel_fallback_line() -> logging.Filter:
    """From now on transformers' kernel fall-back warnings are one line per missing package, said at its first
    (the filter returned). It replaces an earlier run's filter in this process (a second train() call): that one
    would drop the new run's lines as already said."""
    logger = logging.getLogger(KERNELS_LOGGER)
    for earlier in [installed for installed in logger.filters if isinstance(installed, _OneLinePerKernelPackage)]:
        logger.removeFilter(earlier)
    one_line = _OneLinePerKernelPackage()
    logger.addFilter(one_line)
    return one_line


def drop_kernel_fallbacks(record: logging.LogRecord) -> bool:
    """A rank > 0's filter: rank 0 says the kernel fall-backs (one function, so a second run adds it once)."""
    return KERNEL_FALLBACK not in record.getMessage()
