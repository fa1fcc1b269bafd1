"""`torch_compile: true` (sft_recipes.compile): each decoder layer compiled in place before FSDP2 wraps it.

For the Llama, qwen3_5 and gpt-oss twins, one compiled run and one eager run, 2 processes, accelerate's
activation checkpointing on (fsdp2_cpu.yaml): the losses agree within COMPILE_TOLERANCE, and the number of graphs
dynamo compiled (in every step line) stops growing after the first steps. The planner and the linter are asked in-process.
"""

from __future__ import annotations

import re

import pytest

from conftest import REPO_ROOT, TINY_LLAMA_RECIPE, LoggedMessages, launch_sft, read_summary
from sft_recipes.config import RecipeError, load_recipe
from sft_recipes.launch import read_accelerate_config
from sft_recipes.lint import LintContext, lint_recipe
from sft_recipes.planner.report import format_plan, plan_recipe

TINY = REPO_ROOT / "recipes" / "tiny"
LOGGING = ("--save_steps", "1000", "--logging_steps", "1", "--report_to", "none", "--sample_prompts", "[]")
# name: (recipe, arguments, steps, what the run says it compiled). Llama: packed chat blocks whose examples' number
# and lengths change every step, 20 steps, and 4 steps of 256-token blocks under sequence parallelism; qwen3_5: its
# recipe's packed blocks, 6 steps (compiling it is the slow part; the gated-delta layers' per-example torch loops run
# eagerly between graphs); gpt-oss: its recipe's unpacked
# reasoning examples of changing lengths, one a step, LoRA on attention and on the experts (peft's ParamWrapper, run
# eagerly), 5 steps.
TWINS = {
    "llama8b": (TINY_LLAMA_RECIPE, ("--dataset_name", "data/samples/ultrachat.jsonl", "--dataset_format", "messages",
                                    "--pack_blocks", "true", "--max_length", "128"), 20,
                "2 layers (LlamaDecoderLayer)"),
    "qwen27b": (TINY / "qwen27b.yaml", ("--max_length", "128"), 6,
                "6 layers (Qwen3_5DecoderLayer, Qwen3_5VisionBlock)"),
    "gptoss120b": (TINY / "gptoss120b.yaml", ("--gradient_accumulation_steps", "1", "--verify_export", "true"), 5,
                   "2 layers (GptOssDecoderLayer)"),
    # Both processes in one sequence-parallel group: each compiled layer's attention exchanges its half of the block.
    "llama8b-sp2": (
        TINY_LLAMA_RECIPE, ("--dataset_name", "data/samples/ultrachat.jsonl", "--dataset_format", "messages",
                            "--pack_blocks", "true", "--max_length", "256", "--sequence_parallel_size", "2"), 4,
        "2 layers (LlamaDecoderLayer)"),
}
# Inductor fuses and reorders fp32 arithmetic: measured max |compiled - eager| loss at most 1.4e-6 (docs/compile.md)
COMPILE_TOLERANCE = 1e-4
# Graphs compiled after step 3: measured 0 on all three twins. Llama compiles 1 graph at step 1 and nothing after;
# qwen3_5 6 graphs at step 1 and 4 more at step 3, the first block whose examples' lengths change what the graphs
# after its breaks were specialised on (dynamo then compiles them with dynamic sizes), and nothing after; gpt-oss 10
# at step 1 and 12 more at step 2, its first new example length (docs/compile.md).
SETTLED_AFTER_STEP, LATE_GRAPHS_BOUND = 3, 2


@pytest.mark.fsdp
@pytest.mark.parametrize("twin", list(TWINS))
def test_compiled_layers_train_like_eager_without_recompiling_every_step(tmp_path, twin):
    recipe, args, steps, compiled_line = TWINS[twin]
    args = (*args, *LOGGING, "--max_steps", str(steps))
    eager = launch_sft(recipe, *args, "--output_dir", str(tmp_path / "eager"))
    compiled = launch_sft(recipe, *args, "--torch_compile", "true", "--output_dir", str(tmp_path / "compiled"))
    output = compiled.stdout + compiled.stderr
    assert f"[compile] torch.compile on: {compiled_line} compiled in place before FSDP2 wrapping" in output
    assert "[compile]" not in eager.stdout + eager.stderr
    graphs = {int(step): int(count) for step, count in
              re.findall(rf"^step (\d+)/{steps} \| loss .*\| compiled graphs (\d+)", output, re.M)}
    assert list(graphs) == list(range(1, steps + 1)), output[-3000:]
    print(f"{twin}: compiled graphs per step: {graphs}")
    assert graphs[1] > 0 and graphs[steps] - graphs[SETTLED_AFTER_STEP] <= LATE_GRAPHS_BOUND, graphs
    compiled_summary, eager_losses = read_summary(tmp_path / "compiled"), read_summary(tmp_path / "eager")["losses"]
    assert list(compiled_summary["losses"]) == list(eager_losses) == [str(step) for step in range(1, steps + 1)]
    worst = max(abs(compiled_summary["losses"][step] - eager_losses[step]) for step in eager_losses)
    print(f"{twin}: max |compiled - eager| loss over {steps} steps: {worst:.3g}")
    assert worst <= COMPILE_TOLERANCE
    assert compiled_summary["export_max_logit_diff"] <= 1e-4


def test_the_plan_says_whether_compile_and_fp8_are_on():
    config = read_accelerate_config(REPO_ROOT / "accelerate_configs" / "fsdp2_8gpu.yaml")
    for value, shown in ((True, "on: each decoder layer compiled before FSDP2 wrapping"), (False, "off")):
        recipe = load_recipe(REPO_ROOT / "recipes" / "llama8b.yaml", {
            "model_name_or_path": str(REPO_ROOT / "data/realworld/model_configs/meta-llama__Llama-3.1-8B.json"),
            "torch_compile": value, "fp8": value}, planning=True)
        text = format_plan(plan_recipe(recipe, config, 8))
        assert re.search(rf"^  torch\.compile\s+{re.escape(shown)}", text, re.M)
        assert ("the decoder layers' Linear layers in float8 (fp8: true, estimated as bf16)" in text) is value


def test_reading_a_compiling_recipe_without_a_gpu_does_not_warn_that_there_is_no_gpu(tmp_path):
    """transformers' "The speedups for torchdynamo mostly come with GPU Ampere or higher" came from every rank of a
    CPU twin, and from every dry run planning for GPUs."""
    import logging

    logger, records = logging.getLogger("transformers.training_args"), LoggedMessages()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(records)
    try:
        load_recipe(TINY_LLAMA_RECIPE, {"torch_compile": True, "output_dir": str(tmp_path)})
        logger.warning("a warning of its own")
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    assert not any("torchdynamo" in message for message in records.messages)
    assert "a warning of its own" in records.messages


@pytest.mark.parametrize("key, value", [("torch_compile_mode", "max-autotune"), ("torch_compile_backend", "eager")])
def test_a_compile_backend_or_mode_we_do_not_run_is_refused_at_lint_time(tmp_path, key, value):
    recipe = load_recipe(TINY_LLAMA_RECIPE, {key: value, "output_dir": str(tmp_path)})
    with pytest.raises(RecipeError) as refused:
        lint_recipe(recipe, LintContext(world_size=1, has_accelerator=False))
    assert f"{key} set (command line): this project compiles each decoder layer with inductor's default mode" \
        in str(refused.value)
    assert f"remove {key} and set torch_compile: true" in str(refused.value)
