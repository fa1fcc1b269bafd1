"""Know before you launch: parameters, memory per GPU, step time, communication and the layouts to run, from a
recipe and its launch, on the CPU in seconds without weights (`scripts/sft.py RECIPE --dry-run`).

One concern per module, each importing only the ones listed below it (tests/test_planner_package.py):

    dry_run      the `--dry-run` command: lint, plan, print (and --plan-json)
    report       `Plan` (`make_plan`, `plan_recipe`) and the text of the plan and of the layouts compared
    vision       what image data adds: the vision tower, image tokens, the memory they add
    layouts      the layout search: FSDP next to HSDP, what to change, whether an HSDP shard group holds the run
    communication  the time model: compute at an MFU, collectives over NVLink and the network, what compute hides
    memory       the memory model: peak GiB per GPU under FSDP2 (or HSDP), component by component
    setup        `TrainingSetup`, the run a plan is made for, and how a recipe and its launch become one
    model_math   the meta-device model: exact parameter counts, FLOPs per token, the GPU table

Callers import the modules' public names (`from sft_recipes.planner.memory import estimate_memory`); this file
imports nothing, so that `metrics.py` reading `model_math` does not load the dry run.
"""
