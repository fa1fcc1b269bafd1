"""The outcome of the reload check on the run's export, as the card reports it and the Hub push requires it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ExportCheck:
    """`passed` (reloaded logits match the trained model's), `failed` (they do not: never published) or
    `skipped` (the recipe set `verify_export: false`). `detail`: why it failed, or what a passed check left out."""

    status: Literal["passed", "failed", "skipped"]
    max_logit_diff: float | None = None
    detail: str = ""

    @classmethod
    def from_summary(cls, report: dict) -> ExportCheck:
        """The check as run_summary.json records it: a difference (and what was left out), or none when not run."""
        diff = report.get("export_max_logit_diff")
        return cls("skipped") if diff is None else cls("passed", diff, report.get("export_check_left_out", ""))

    def describe(self) -> str:
        if self.status == "passed":
            return ("passed: the reloaded export reproduces the trained model's logits "
                    f"(max abs difference {self.max_logit_diff:.3g}{'; ' + self.detail if self.detail else ''})")
        if self.status == "failed":
            return f"FAILED: {self.detail or 'the reloaded export does not reproduce the trained model'}"
        return "not run (verify_export: false)"
