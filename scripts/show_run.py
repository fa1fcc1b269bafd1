#!/usr/bin/env python3
"""Show what a finished run left behind (summary, curves picture, samples, card), proving the checkpoint loads
with plain transformers.

    make show OUT=outputs/demo        (or: .venv/bin/python scripts/show_run.py outputs/demo)

A folder that is not a finished run's output_dir (none there, a Trainer checkpoint-N inside one, a run that did
not finish) is one `error:` line, exit 2.
"""

from __future__ import annotations

import argparse
import json
from importlib.metadata import version
from pathlib import Path

import torch

from sft_recipes.command_line import OneLineParser
from sft_recipes.errors import RecipeError, one_line_refusals
from sft_recipes.reporting.export_check import ExportCheck
from sft_recipes.reporting.load_export import export_kind, load_export, output_dir_refusal
from sft_recipes.reporting.samples import PROMPT_STYLES, prompt_ids
from sft_recipes.script_exit import run_then_exit


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="scripts/show_run.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir", help="a finished run's output_dir, e.g. outputs/demo")
    args = parser.parse_args(argv)
    return one_line_refusals(lambda: show(Path(args.output_dir)))


def show(out: Path) -> int:
    try:
        summary = json.loads((out / "run_summary.json").read_text())
        adapter = export_kind(out) == "adapter"
    except (OSError, ValueError):
        raise RecipeError(output_dir_refusal(out, "holds no finished run (no readable run_summary.json and export)",
                                             "make show OUT={}")) from None
    model, tokenizer = load_export(out)  # a LoRA adapter loads onto the base its adapter_config.json names
    question = "What is 2 + 3?"
    style = summary.get("prompt_style", "alpaca")  # asked as the run trained; runs before the key: the alpaca twin
    input_ids = torch.tensor([prompt_ids(tokenizer, question, style)])
    with torch.no_grad():
        generated = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=12,
                                   do_sample=False, pad_token_id=tokenizer.pad_token_id)
    completion = tokenizer.decode(generated[0, input_ids.shape[1] :], skip_special_tokens=True)

    print(f"\n== run in {out} ==")
    print(f"  distributed        {summary['distributed']}")
    print(f"  steps              {summary['steps']} ({summary['seconds_per_step']} s/step), final loss {summary['final_loss']:.4f}")
    if summary.get("eval_losses"):
        evals = ", ".join(f"step {step}: {loss:.4f}" for step, loss in summary["eval_losses"].items())
        print(f"  eval loss          {evals} (token-weighted mean over the held-out rows)")
    files = [*sorted(p.name for p in out.glob("*.safetensors")), "adapter_config.json" if adapter else "config.json"]
    print(f"  checkpoint         {out}/ ({', '.join(files)}, tokenizer)")
    loaded = f"{type(model.get_base_model()).__name__} + its LoRA adapter (peft)" if adapter else type(model).__name__
    print(f"  reloaded as        {loaded}")
    print(f"  export check       {ExportCheck.from_summary(summary).describe()}")
    print(f"  sample generation  {question!r} -> {completion.strip()!r} (asked with the {PROMPT_STYLES[style]})")
    if summary.get("stand_in_note"):
        print(f"                     {summary['stand_in_note']}")
    benchmarks = summary.get("benchmarks")
    if benchmarks:  # eval_tasks: base vs tuned (docs/evaluation.md)
        from sft_recipes.scores.compare import comparison_lines

        lines = comparison_lines(benchmarks["tasks"]) or [f"scoring failed: {benchmarks['error']}"]
        print(f"  benchmarks         {lines[0]}")
        for line in lines[1:]:
            print(f"                     {line}")
        picture = out / "benchmark_scores.png"
        print(f"  benchmarks picture {picture if picture.is_file() else 'none'}")
    print(f"  checkpoints        {', '.join(sorted(p.name for p in out.glob('checkpoint-*'))) or 'none'} (resume: rerun the same command)")
    print(f"  summary            {out}/run_summary.json")
    for name, label in (("training_curves.png", "curves picture"), ("samples.md", "sample answers"),
                        ("README.md", "model card"), ("train.log", "console log")):
        shown = f"{out / name}{' (before and after training)' if name == 'samples.md' else ''}"
        print(f"  {label:<19}{shown if (out / name).is_file() else 'none'}")
    print(f"  chat with it       make chat OUT={out}   (one answer: make chat OUT={out} ARGS='--prompt \"Hi\"')")
    if summary.get("mlflow_tracking_uri"):
        uri = summary["mlflow_tracking_uri"]
        print(f"  MLflow             run {summary['mlflow_run_id']} in {uri}")
        mlflow = f"mlflow=={version('mlflow-skinny')}"  # the UI of the client that wrote the runs
        print(f"  MLflow UI          .venv/bin/pip install {mlflow} && .venv/bin/mlflow ui --backend-store-uri {uri}")
    return 0


if __name__ == "__main__":
    run_then_exit(main)  # a clean end skips the interpreter's teardown of the loaded stack (script_exit)
