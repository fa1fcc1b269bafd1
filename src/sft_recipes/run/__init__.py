"""The assembly of one run: each decision made once, in one place, and handed down already decided.

    run = start_run(recipe)                        # setup.py: lint, global batch, FSDP2, output_dir, model source
    data = build_data(run, tokenizer)             # data.py: rows -> train dataset (+ collator), data report
    model = build_model(run)                      # model.py: load, freeze a VLM tower, packing fixes, LoRA, guards
    training = build_trainer(run, data, model, tokenizer)   # training.py: every callback wired inside
    training.run()                                # resume policy, timing
    result = finish(run, training)                # finish.py: export, check, summary -> RunResult

`complete_run(run)` (complete.py) is every step after `start_run`, shared by scripts/sft.py and
`sft_recipes.train()` (python_api.py).
"""

from sft_recipes.run.complete import complete_run
from sft_recipes.run.data import RunData, audit_data, build_data
from sft_recipes.run.finish import RunResult, earlier_result, finish
from sft_recipes.run.model import RunModel, build_model
from sft_recipes.run.setup import Run, start_run
from sft_recipes.run.training import Training, build_trainer

__all__ = ["Run", "RunData", "RunModel", "RunResult", "Training", "audit_data", "build_data", "build_model",
           "build_trainer", "complete_run", "earlier_result", "finish", "start_run"]
