"""The outcome of the reload check on the run's export, as the card reports it and the Hub push requires it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ExportCheck:
    """`passed` (reloaded logits match the trained model's), `failed` (they do not: never published) or
    `skipped` (the recipe set `verify_export: false`)."""

    status: Literal["passed", "failed", "skipped"]
    max_logit_diff: float | None = None
    detail: str = ""

    @classmethod
    def from_logit_diff(cls, max_logit_diff: float | None) -> ExportCheck:
        """What `export_run` returns after a check that did not raise: a difference, or None when not run."""
        return cls("skipped") if max_logit_diff is None else cls("passed", max_logit_diff)

    def describe(self) -> str:
        if self.status == "passed":
            return ("passed: the reloaded export reproduces the trained model's logits "
                    f"(max abs difference {self.max_logit_diff:.3g})")
        if self.status == "failed":
            return f"FAILED: {self.detail or 'the reloaded export does not reproduce the trained model'}"
        return "not run (verify_export: false)"
