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
    return _whole_number_at_least(1, fix)


def non_negative_int(fix: str):
    """An argparse type: a whole number >= 0; `fix` says what to give."""
    return _whole_number_at_least(0, fix)


def _whole_number_at_least(minimum: int, fix: str):
    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text} is not a whole number >= {minimum}: give {fix}")
        return value

    return whole_number


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


def sft_script_parser(description: str | None = None) -> OneLineParser:
    """scripts/sft.py's own options; the rest of its command line is `--key value` recipe overrides
    (`parse_known_args`). The launch pre-check reads them too, to refuse the ones that do not train."""
    # allow_abbrev off: a recipe override never reads as the start of one of these (`--plan` as `--plan-json`)
    parser = OneLineParser(prog="scripts/sft.py", description=description, allow_abbrev=False,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/llama8b.yaml")
    parser.add_argument("--dry-run", action="store_true",
                        help="lint the recipe and print the plan (parameters, memory per GPU, fit, time); no GPU, no weights")
    parser.add_argument("--config_file", help="with --dry-run: the accelerate config the run will be launched with")
    parser.add_argument("--world_size", type=positive_int("the number of processes to plan for"),
                        help="with --dry-run: number of processes (overrides --config_file)")
    parser.add_argument("--plan-json", help="with --dry-run: also write the plan as JSON to this path")
    parser.add_argument("--workload", help="with --dry-run: check this AI Runtime workload file (as `python -m "
                        "sft_recipes.workload check` does) and plan with its parameters and accelerate config")
    parser.add_argument("--gpu", choices=("H100", "H200", "B200", "B300"),
                        help="with --dry-run: the GPU the communication estimate, layout comparison and suggestions are "
                             "for (default: the --workload's accelerator_type, else the one the recipe's first header "
                             "line names, else H100)")
    parser.add_argument("--intra_node_gbps", type=float,
                        help="with --dry-run: NVLink Gb/s per GPU each way (default: the --gpu's, docs/planner.md)")
    parser.add_argument("--inter_node_gbps", type=float,
                        help="with --dry-run: network Gb/s per GPU each way (default: the --gpu's node, e.g. 400)")
    parser.add_argument("--audit-data", type=positive_int("how many conversations to show"), metavar="N", default=0,
                        help="show N conversations with their supervised spans marked, report mask statistics, stop")
    return parser


def options_that_do_not_train(recipe: str, arguments: list[str]) -> list[str]:
    """The scripts/sft.py options among `arguments` (a launch's, after the recipe) that plan or audit instead of
    training, as written (`--dry-run`, `--audit-data`, and the dry run's own: `--gpu`, ...)."""
    _, overrides = sft_script_parser().parse_known_args([recipe, *arguments])
    return [token for token in arguments if token.startswith("--") and token not in overrides]
