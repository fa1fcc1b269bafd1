#!/usr/bin/env python3
"""Score a model on benchmark tasks with EleutherAI's lm-evaluation-harness (docs/evaluation.md).

    .venv/bin/python scripts/evaluate.py outputs/demo --tasks alpaca_answers gsm8k_local --limit 20
    make eval OUT=outputs/demo TASKS="alpaca_answers gsm8k_local" ARGS="--limit 20"
    .venv/bin/accelerate launch --num_processes 8 scripts/evaluate.py outputs/run --tasks gsm8k_local   # 8 GPUs
    .venv/bin/python scripts/evaluate.py outputs/run --tasks gsm8k_local --backend vllm                # pip install vllm

MODEL is a run's output_dir (its export: a consolidated checkpoint, or a LoRA adapter merged onto its base on
the fly), any local model folder, or a Hugging Face Hub model id (--revision). A task is one shipped in
evals/tasks/ (alpaca_answers, gsm8k_local, ifeval_local), a local lm-eval task YAML, or an lm-eval registry task
(its data comes from the Hub). Prints a table and writes the scores as JSON (--output; default MODEL/benchmark_results.json
for a folder). The same code scores a recipe's eval_tasks after training, so the numbers are the run's.

Under `accelerate launch --num_processes N` (on CPU add --multi_gpu, which makes accelerate start N processes:
they run on gloo) every process holds the whole model and scores its share of each task's requests in
lm-eval's data-parallel mode; rank 0 prints and writes the scores. `--backend vllm` scores with lm-eval's vLLM
model instead (one process; vLLM runs its own workers).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import re
import sys
import tempfile
from datetime import timedelta
from functools import partial
from pathlib import Path

from sft_recipes.environment import set_runtime_defaults

set_runtime_defaults()

from sft_recipes.command_line import OneLineParser, non_negative_int, positive_int
from sft_recipes.errors import RecipeError, one_line_refusals
from sft_recipes.script_exit import run_then_exit

RESULTS_FILE = "benchmark_results.json"
BACKENDS = {"hf": "transformers, in this process or in every process of the launch",
            "vllm": "lm-eval's vLLM model, one process (pip install vllm)"}


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(prog="scripts/evaluate.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a run's output_dir, a model folder, or a Hub model id")
    parser.add_argument("--tasks", nargs="+", required=True, help="task names or task YAML files (or one "
                        "comma-separated argument)")
    parser.add_argument("--limit", type=positive_int("examples per task (the first N); leave it out for all"),
                        help="examples per task (the first N); default: all")
    parser.add_argument("--num_fewshot", type=non_negative_int("few-shot examples per prompt (0: none); leave it out "
                                                               "for each task's own"),
                        help="few-shot examples per prompt; default: each task's own")
    parser.add_argument("--max_gen_toks", type=positive_int("the most tokens a generated answer may have"),
                        help="longest generated answer; default: each task's own")
    parser.add_argument("--apply_chat_template", action="store_true", help="prompt through the chat template")
    parser.add_argument("--batch_size", type=positive_int("the requests scored together (default 8)"), default=8)
    parser.add_argument("--seed", type=int, default=0, help="lm-eval's seeds (few-shot choice); the recipes' seed")
    parser.add_argument("--device", help="where the model runs (default: cuda when there is a GPU, else cpu; "
                        "under a launch each process's own device); the hf backend's")
    parser.add_argument("--backend", default="hf", help="lm-eval's model: " + "; ".join(
        f"{name}: {what}" for name, what in BACKENDS.items()) + " (default: hf)")
    parser.add_argument("--revision", help="a Hub model's revision")
    parser.add_argument("--cache_dir", help="reuse and keep scores here (a recipe's eval_cache_dir); default: none")
    parser.add_argument("--output", help=f"results JSON (default: MODEL/{RESULTS_FILE} for a folder, else ./"
                        f"{RESULTS_FILE})")
    return parser.parse_args(argv)


def load_model(name_or_path: str, revision: str | None):
    """(model, tokenizer): a run's export (an adapter merged onto its base), a model folder, or a Hub id."""
    from transformers import AutoTokenizer

    from sft_recipes.loading import cache_only, model_class_for
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
        offline = cache_only(name_or_path)  # the Hub cannot be asked: the cache only, without ~30 s of retries
        config = hub_config(name_or_path, revision, offline)
        model = model_class_for(config).from_pretrained(name_or_path, revision=revision, local_files_only=bool(offline))
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, revision=revision, local_files_only=bool(offline))
    model.config.use_cache = True
    return model.eval(), tokenizer


def hub_config(name: str, revision: str | None, offline: str | None):
    """A Hub model's config (from the cache only where `offline` says why the Hub cannot be asked); a name that is
    neither a folder here nor a model the Hub gives is one refusal."""
    from transformers import AutoConfig

    from sft_recipes.loading import a_mistyped_local_folder

    if name.startswith((".", "/", "~")):  # a path, never a Hub id
        raise RecipeError(f"MODEL {name!r} is not a folder here: pass a run's output_dir, a model folder, or a Hub id")
    mistyped = a_mistyped_local_folder(name)
    if mistyped:
        raise RecipeError(f"MODEL {name!r} {mistyped}: pass a run's output_dir, a model folder, or a Hub id")
    try:
        return AutoConfig.from_pretrained(name, revision=revision, local_files_only=bool(offline))
    except OSError as err:  # no such repo or revision, no network, a gated model without a token
        if offline:
            raise RecipeError(f"MODEL {name!r} is not a folder here nor in the Hugging Face cache, and the Hub cannot "
                              f"be asked for it ({offline}): pass a run's output_dir, a model folder, or a Hub id "
                              "(run where the Hub answers; HF_TOKEN for a gated model)") from None
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RecipeError(f"MODEL {name!r} is not a folder here and not a model the Hugging Face Hub gives ({reason}): "
                          "pass a run's output_dir, a model folder, or a Hub id (with --revision; HF_TOKEN for a gated "
                          "model)") from None


def launch_refusal(args: argparse.Namespace) -> str | None:
    """Why this launch cannot score in lm-eval's data-parallel mode (None: it can, or it is one process)."""
    from sft_recipes.distributed import launch_flag, launched_world_size

    world_size = launched_world_size()
    if world_size <= 1:
        return None
    launched = f"scripts/evaluate.py runs under a launch of {world_size} processes"
    if args.backend == "vllm":
        return (f"{launched}, but --backend vllm runs in one process (vLLM starts its own workers): run "
                "`.venv/bin/python scripts/evaluate.py ... --backend vllm`, or launch with --backend hf")
    if launch_flag("ACCELERATE_USE_FSDP") or launch_flag("ACCELERATE_USE_DEEPSPEED"):
        return (f"{launched} with an FSDP or DeepSpeed config, but lm-eval's data-parallel mode does not shard the "
                "model (every process holds a whole copy): launch without --config_file, e.g. `.venv/bin/accelerate "
                "launch --num_processes N scripts/evaluate.py ...` (on CPU add --multi_gpu)")
    if args.device:
        return (f"{launched}, where each process scores on its own device: drop --device (launch "
                "`--num_processes N` for N GPUs)")
    return None


def data_parallel_accelerator():
    """The launch's Accelerator (gloo on CPU, NCCL on GPUs), as lm-eval's own launch builds it; None for one
    process."""
    from sft_recipes.distributed import launched_world_size

    if launched_world_size() <= 1:
        return None
    import torch
    from accelerate import Accelerator, InitProcessGroupKwargs

    # lm-eval's timeout: a rank waits for the others' share of a long task; a failed rank ends the launch anyway
    return Accelerator(cpu=not torch.cuda.is_available(),
                       kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(weeks=52))])


def vllm_model(args: argparse.Namespace, settings, folders: contextlib.ExitStack):
    """lm-eval's vLLM model on MODEL: a folder or Hub id as it is, an adapter merged into a temporary folder."""
    from sft_recipes.loading import cache_only
    from sft_recipes.reporting.load_export import export_kind
    from sft_recipes.scores import import_lm_eval

    path = args.model
    try:
        adapter = Path(path).is_dir() and export_kind(path) == "adapter"
    except ValueError as err:  # a folder without a model
        raise RecipeError(str(err)) from None
    if adapter:  # vLLM loads whole models: merge, save, score that
        model, tokenizer = load_model(path, args.revision)
        path = folders.enter_context(tempfile.TemporaryDirectory(prefix="evaluate-merged-"))
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        del model
    elif not Path(path).is_dir():
        # refused here, before vLLM starts, if neither the Hub nor its cache gives it
        hub_config(path, args.revision, cache_only(path))
    import_lm_eval()
    from lm_eval.models.vllm_causallms import VLLM

    return VLLM(pretrained=path, revision=None if Path(path).is_dir() else args.revision, seed=settings.seed,
                batch_size="auto")  # vLLM schedules its own batches


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    args = parse_command_line(sys.argv[1:] if argv is None else argv)
    if args.backend not in BACKENDS:
        raise RecipeError(f"--backend {args.backend!r} is not offered: use --backend hf (transformers, the default) "
                          "or --backend vllm (lm-eval's vLLM model; pip install vllm)")
    if (problem := launch_refusal(args)) is not None:
        raise RecipeError(problem)
    if args.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise RecipeError("--backend vllm needs vLLM, which is not installed: `.venv/bin/pip install vllm` (on a "
                          "machine with GPUs), or score with --backend hf (transformers, the default)")
    from sft_recipes.scores.compare import console_table
    from sft_recipes.scores.harness import EvalSettings, model_key, score_lm, score_model
    from sft_recipes.scores.tasks import parse_tasks

    entries = [name for arg in args.tasks for name in arg.split(",") if name]
    try:
        tasks = parse_tasks(entries, args.limit, args.num_fewshot)
    except ValueError as err:  # worded for a recipe's eval_tasks; here the user wrote --tasks
        raise RecipeError(re.sub(r"^eval_tasks\b", "--tasks", str(err))) from None
    settings = EvalSettings(batch_size=args.batch_size, max_gen_toks=args.max_gen_toks,
                            apply_chat_template=args.apply_chat_template, seed=args.seed, backend=args.backend)
    key = model_key(args.model, args.revision)
    accelerator = data_parallel_accelerator()
    processes = 1 if accelerator is None else accelerator.num_processes
    with contextlib.ExitStack() as folders:
        if args.backend == "vllm":
            scores = score_lm(lambda: vllm_model(args, settings, folders), tasks, settings, args.cache_dir, key)
            where = "1 process (vLLM)"
        else:
            model, tokenizer = load_model(args.model, args.revision)
            if accelerator is not None:
                args.device = str(accelerator.device)
            elif args.device is None:
                import torch

                args.device = "cuda" if torch.cuda.is_available() else "cpu"
            model = model.to(args.device)
            scores = score_model(model, tokenizer, tasks, settings, args.cache_dir, key, accelerator)
            where = (f"1 process ({args.device})" if accelerator is None else
                     f"{processes} processes (lm-eval's data-parallel mode, {accelerator.device.type}, "
                     f"{accelerator.state.backend})")
    if accelerator is not None and not accelerator.is_main_process:
        return 0
    print(f"scored on {where}")
    print(console_table(scores))
    output = Path(args.output) if args.output else (
        Path(args.model) / RESULTS_FILE if Path(args.model).is_dir() else Path(RESULTS_FILE))
    output.write_text(json.dumps({"model": args.model, "revision": args.revision, "processes": processes,
                                  "settings": vars(args),
                                  "tasks": {name: score.as_dict() for name, score in scores.items()}}, indent=2))
    print(f"scores: {output}")
    return 0


def main_then_tear_down() -> int:
    from sft_recipes.distributed import process_group_destroyed_on_exit

    with process_group_destroyed_on_exit():  # a launch's gloo/NCCL group, stopped before the interpreter's exit
        return main()


if __name__ == "__main__":
    # the `error:` line, if any, is the last thing written; a clean end skips the interpreter's teardown (script_exit)
    run_then_exit(partial(one_line_refusals, main_then_tear_down))
