#!/usr/bin/env python3
"""Supervised fine-tuning with TRL's SFTTrainer, driven by one recipe YAML.

    .venv/bin/accelerate launch --config_file accelerate_configs/fsdp2_8gpu.yaml scripts/sft.py recipes/llama8b.yaml
    .venv/bin/accelerate launch --config_file accelerate_configs/fsdp2_cpu.yaml scripts/sft.py recipes/tiny/llama8b.yaml \
        --max_steps 5 --output_dir outputs/try

Any recipe key can be overridden with `--key value` (and by a workload's `parameters:` block, named
by HYPERPARAMETERS_PATH). Every decision lives in `sft_recipes.run`; this file is the table of
contents of a run, and `sft_recipes.train()` runs the same steps from Python. A refusal you can fix
is one `error:` line, exit 2.
"""

from __future__ import annotations

import logging
import sys
from functools import partial

from sft_recipes.environment import set_runtime_defaults

set_runtime_defaults()  # before anything imports huggingface_hub or touches CUDA

from sft_recipes.command_line import sft_script_parser
from sft_recipes.config import load_recipe
from sft_recipes.distributed import process_group_destroyed_on_exit
from sft_recipes.errors import one_line_refusals
from sft_recipes.reporting.mlflow_status import mlflow_run_ended_by_outcome
from sft_recipes.run import audit_data, complete_run, start_run
from sft_recipes.script_exit import run_then_exit


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    cli, overrides = sft_script_parser(__doc__).parse_known_args(sys.argv[1:] if argv is None else argv)
    if cli.dry_run:  # lint + plan, in seconds, without GPUs or weights (imported here: a training run never plans)
        from sft_recipes.planner.dry_run import plan_dry_run
        from sft_recipes.workload import dry_run_as_the_workload

        if cli.workload:  # the workload check, then the plan of what it launches, on the GPU it asks for
            config_file, gpu = dry_run_as_the_workload(cli.workload, overrides)
            cli.config_file, cli.gpu = cli.config_file or config_file, cli.gpu or gpu
        print(plan_dry_run(cli.recipe, overrides, cli.config_file, cli.world_size, cli.plan_json, cli.gpu,
                           cli.intra_node_gbps, cli.inter_node_gbps))
        return 0

    # ── Parse ─────────────────────────────────────────────────────────────────────────────────
    run = start_run(load_recipe(cli.recipe, overrides), read_only=bool(cli.audit_data))
    if run.finished:  # resumed at max_steps already: said so, nothing trained or written
        return 0

    if cli.audit_data:  # the conversations as the model will see them, then stop
        print(audit_data(run, run.source.load_tokenizer(), cli.audit_data))
        return 0

    # ── Tokenizer, data, model, trainer, train, finish (sft_recipes.run.complete_run) ─────────
    complete_run(run)
    return 0


def main_then_tear_down() -> int:
    with process_group_destroyed_on_exit(), mlflow_run_ended_by_outcome():  # a failed attempt's run: not FINISHED
        return main()


if __name__ == "__main__":
    # the `error:` line, if any, is the last thing written; a clean end skips the interpreter's teardown (script_exit)
    run_then_exit(partial(one_line_refusals, main_then_tear_down))
