"""Command lines that refuse a wrong option as the rest of the product refuses: one `error:` line, exit 2.

argparse's own refusal is its usage block and `prog: error: ...`, printed by every rank of a launch; a launched
rank that exits first gets the others stopped by the launcher (exit -15, not 2). `OneLineParser` refuses through
`errors.refuse` instead: rank 0's one line, every rank's exit 2 (`--help` still prints the usage).
"""

from __future__ import annotations

import argparse
import math

from sft_recipes.errors import refuse


class OneLineParser(argparse.ArgumentParser):
    """argparse whose refusal of a wrong command line is one `error:` line and exit 2, without the usage block.
    The argument types below end their messages with the fix; argparse's own messages point at --help."""

    def error(self, message: str):
        fix = "" if ": give " in message else f" (see {self.prog} --help)"
        raise SystemExit(refuse(f"{message}{fix}"))


def positive_int(fix: str):
    """An argparse type: a whole number >= 1; `fix` says what to give, e.g. "the most tokens (default 256)"."""

    def whole_number_at_least_one(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{text} is not a whole number >= 1: give {fix}")
        return value

    return whole_number_at_least_one


def non_negative_float(fix: str):
    """An argparse type: a finite number >= 0; `fix` says what to give."""

    def number_at_least_zero(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise argparse.ArgumentTypeError(f"{text} is not a number >= 0: give {fix}")
        return value

    return number_at_least_zero
