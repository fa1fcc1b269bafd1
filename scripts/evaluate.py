#!/usr/bin/env python3
"""Score a model on benchmark tasks with EleutherAI's lm-evaluation-harness (docs/evaluation.md).

    .venv/bin/python scripts/evaluate.py outputs/demo --tasks alpaca_answers gsm8k_local --limit 20
    make eval OUT=outputs/demo TASKS="alpaca_answers gsm8k_local" ARGS="--limit 20"

MODEL is a run's output_dir (its export: a consolidated checkpoint, or a LoRA adapter merged onto its base on
the fly), any local model folder, or a Hugging Face Hub model id (--revision). A task is one shipped in
evals/tasks/ (alpaca_answers, gsm8k_local), a local lm-eval task YAML, or an lm-eval registry task (its data
comes from the Hub). Prints a table and writes the scores as JSON (--output; default MODEL/benchmark_results.json
for a folder). The same code scores a recipe's eval_tasks after training, so the numbers are the run's.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from sft_recipes.environment import set_runtime_defaults

set_runtime_defaults()

from sft_recipes.errors import RecipeError, one_line_refusals

RESULTS_FILE = "benchmark_results.json"


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a run's output_dir, a model folder, or a Hub model id")
    parser.add_argument("--tasks", nargs="+", required=True, help="task names or task YAML files (or one "
                        "comma-separated argument)")
    parser.add_argument("--limit", type=int, help="examples per task (the first N); default: all")
    parser.add_argument("--num_fewshot", type=int, help="few-shot examples per prompt; default: each task's own")
    parser.add_argument("--max_gen_toks", type=int, help="longest generated answer; default: each task's own")
    parser.add_argument("--apply_chat_template", action="store_true", help="prompt through the chat template")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="lm-eval's seeds (few-shot choice); the recipes' seed")
    parser.add_argument("--device", help="where the model runs (default: cuda when there is a GPU, else cpu)")
    parser.add_argument("--revision", help="a Hub model's revision")
    parser.add_argument("--cache_dir", help="reuse and keep scores here (a recipe's eval_cache_dir); default: none")
    parser.add_argument("--output", help=f"results JSON (default: MODEL/{RESULTS_FILE} for a folder, else ./"
                        f"{RESULTS_FILE})")
    return parser.parse_args(argv)


def load_model(name_or_path: str, revision: str | None):
    """(model, tokenizer): a run's export (an adapter merged onto its base), a model folder, or a Hub id."""
    from transformers import AutoConfig, AutoTokenizer

    from sft_recipes.loading import model_class_for
    from sft_recipes.reporting.load_export import export_kind, load_export

    if Path(name_or_path).is_dir():
        try:
            export_kind(name_or_path)
        except ValueError as err:
            raise RecipeError(str(err)) from None
        model, tokenizer = load_export(name_or_path)
        if hasattr(model, "merge_and_unload"):  # a PEFT adapter: scored merged, as it would be served
            model = model.merge_and_unload()
    else:
        config = AutoConfig.from_pretrained(name_or_path, revision=revision)
        model = model_class_for(config).from_pretrained(name_or_path, revision=revision)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, revision=revision)
    model.config.use_cache = True
    return model.eval(), tokenizer


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    args = parse_command_line(sys.argv[1:] if argv is None else argv)
    from sft_recipes.scores.compare import console_table
    from sft_recipes.scores.harness import EvalSettings, model_key, score_model
    from sft_recipes.scores.tasks import parse_tasks

    entries = [name for arg in args.tasks for name in arg.split(",") if name]
    try:
        tasks = parse_tasks(entries, args.limit, args.num_fewshot)
    except ValueError as err:
        raise RecipeError(str(err)) from None
    settings = EvalSettings(batch_size=args.batch_size, max_gen_toks=args.max_gen_toks,
                            apply_chat_template=args.apply_chat_template, seed=args.seed)
    model, tokenizer = load_model(args.model, args.revision)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(args.device)
    scores = score_model(model, tokenizer, tasks, settings, args.cache_dir, model_key(args.model, args.revision))
    print(console_table(scores))
    output = Path(args.output) if args.output else (
        Path(args.model) / RESULTS_FILE if Path(args.model).is_dir() else Path(RESULTS_FILE))
    output.write_text(json.dumps({"model": args.model, "revision": args.revision, "settings": vars(args),
                                  "tasks": {name: score.as_dict() for name, score in scores.items()}}, indent=2))
    print(f"scores: {output}")
    return 0


if __name__ == "__main__":
    sys.exit(one_line_refusals(main))
