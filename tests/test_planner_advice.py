"""The dry run's advice agrees with itself (issue #27 item 2): the faster layout is the faster one, a multi-node
suggestion is the command a cluster runs, one run has one step time, and a suggestion leaves the stated headroom."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from sft_recipes.errors import RecipeError
from sft_recipes.planner.dry_run import plan_dry_run
from sft_recipes.planner.report import suggested_launch
from sft_recipes.tiny import REALWORLD_DIR

CONFIGS = REALWORLD_DIR / "model_configs"
LLAMA_8B = str(CONFIGS / "meta-llama__Llama-3.1-8B.json")
QWEN_27B = str(CONFIGS / "Qwen__Qwen3.5-27B.derived.json")
GPT_OSS_120B = str(CONFIGS / "openai__gpt-oss-120b.derived.json")


def dry_run(tmp_path, recipe: str, model: str, config_file: str, *overrides: str, **flags) -> tuple[str, dict]:
    plan_json = tmp_path / f"{recipe}.{config_file}.json"
    text = plan_dry_run(f"recipes/{recipe}", ["--model_name_or_path", model, *overrides],
                        f"accelerate_configs/{config_file}", plan_json=str(plan_json), **flags)
    return text, json.loads(plan_json.read_text())


def faster_line(text: str) -> tuple[str, dict[str, float]]:
    """(the layout the line calls faster, {layout: s/step} it quotes)."""
    [line] = [line for line in text.splitlines() if line.startswith("  faster layout that fits: ")]
    named, times = re.match(r"  faster layout that fits: (.+?) \((.+?) per step\)", line).groups()
    return named, {name: float(seconds) for name, seconds in re.findall(r"(FSDP|HSDP \d+x\d+) ([\d.]+) s", times)}


def test_the_faster_layout_is_the_faster_one_and_the_model_says_why_hsdp_does_not_win(tmp_path):
    # the case: on 4 nodes HSDP 4x8 (the config's) is 1.3% slower than flat FSDP and needs more memory
    text, plan = dry_run(tmp_path, "llama8b.yaml", LLAMA_8B, "hsdp_4node.yaml")
    named, times = faster_line(text)
    assert times == {"FSDP": 0.498, "HSDP 4x8": 0.505}
    assert named == "FSDP" == plan["faster_layout_that_fits"]
    assert "1.3% faster than the launch's own HSDP 4x8: under 5%, within the model's error, so keep the launch's own" \
        in text and plan["layout_to_launch"] == "HSDP 4x8"
    assert "HSDP 4x8 against flat FSDP, in this model: network busy 0.151 s against 0.188 s, exposed 0.030 s against " \
           "0.024 s per step, 27.2 GiB per GPU against 15.4: the two are within 5% here (HSDP 1.3% slower)." in text


def test_on_a_slow_network_with_bf16_reduction_hsdp_wins_and_is_named_so(tmp_path):
    text, plan = dry_run(tmp_path, "llama8b.yaml", LLAMA_8B, "hsdp_4node.yaml", "--fsdp_reduce_dtype", "bfloat16",
                         inter_node_gbps=50)
    named, times = faster_line(text)
    assert named == "HSDP 4x8" and times["HSDP 4x8"] < times["FSDP"] / 1.05
    assert ": HSDP wins here. HSDP wins when" in text and plan["faster_layout_that_fits"] == plan["layout_to_launch"] == "HSDP 4x8"


def test_multi_node_suggestions_are_the_command_every_node_runs(tmp_path):
    text, plan = dry_run(tmp_path, "llama8b.yaml", LLAMA_8B, "hsdp_4node.yaml")
    assert plan["suggestions"] and "accelerate launch" not in text
    commands = [line.strip() for line in text.splitlines() if "recipes/llama8b.yaml" in line]
    assert len(commands) == len(plan["suggestions"])
    assert all(c.startswith("scripts/launch_multinode.sh my_accelerate_config.yaml recipes/llama8b.yaml ")
               for c in commands)
    assert "run on every node; best first):" in text
    # a shipped config replaces the launch's own, in either form of the command
    assert suggested_launch("scripts/launch_multinode.sh accelerate_configs/fsdp2_2node.yaml recipes/llama8b.yaml",
                            ("--per_device_train_batch_size", "2"), "accelerate_configs/hsdp_2node.yaml") == [
        "scripts/launch_multinode.sh accelerate_configs/hsdp_2node.yaml recipes/llama8b.yaml "
        "--per_device_train_batch_size 2"]


def test_a_suggestion_with_shorter_blocks_plans_what_it_says_when_launched_as_printed(tmp_path):
    """Nothing fits 1M-token blocks, so the suggestions shorten them; llama8b states its global batch in sequences
    (128), so the printed launch says the new count (--global_batch_size), and states each key once."""
    text, plan = dry_run(tmp_path, "llama8b.yaml", LLAMA_8B, "fsdp2_2node.yaml", "--max_length", "1000000")
    shortened = [option for option in plan["suggestions"] if option["max_length"] < 1_000_000]
    assert shortened and all(option["accelerate_config"] in (None, "accelerate_configs/hsdp_2node.yaml")
                             for option in shortened)
    for option in shortened:
        [printed] = [line.strip() for line in text.splitlines() if line.strip().endswith(" ".join(option["overrides"]))
                     and f"{option['accelerate_config'] or 'fsdp2_2node.yaml'} recipes/llama8b.yaml" in line]
        arguments = printed.split(" recipes/llama8b.yaml ", 1)[1].split()
        assert arguments.count("--max_length") == 1, printed
        config = (option["accelerate_config"] or "accelerate_configs/fsdp2_2node.yaml").removeprefix("accelerate_configs/")
        _, launched = dry_run(tmp_path / "launched", "llama8b.yaml", LLAMA_8B, config,
                              *arguments[arguments.index("--model_name_or_path") + 2:])
        assert (launched["sequences_per_step"], launched["setup"]["seq_len"], launched["setup"]["micro_batch_size"]) \
            == (option["sequences_per_step"], option["max_length"], option["micro_batch_size"])
        assert launched["sequences_per_step"] * option["max_length"] == 128 * 1_000_000  # the recipe's tokens per step


def test_a_printed_launch_keeps_a_value_with_spaces_as_one_argument(tmp_path):
    datasets = "[{path: data/samples/ultrachat.jsonl, dataset_format: messages}]"
    text, _ = dry_run(tmp_path, "llama8b.yaml", LLAMA_8B, "fsdp2_2node.yaml", "--max_length", "1000000",
                      "--datasets", datasets, "--dataset_name", "null")
    printed = [line.strip() for line in text.splitlines() if "recipes/llama8b.yaml" in line]
    assert printed and all(shlex.split(line)[shlex.split(line).index("--datasets") + 1] == datasets for line in printed)


def test_a_plan_json_path_is_made_or_refused_in_one_line(tmp_path):
    dry_run(tmp_path / "new" / "folder", "llama8b.yaml", LLAMA_8B, "fsdp2_2node.yaml")  # its folder is made
    (tmp_path / "a_file").write_text("")
    with pytest.raises(RecipeError) as refused:
        plan_dry_run("recipes/llama8b.yaml", ["--model_name_or_path", LLAMA_8B], "accelerate_configs/fsdp2_2node.yaml",
                     plan_json=str(tmp_path / "a_file" / "plan.json"))
    assert str(refused.value) == (f"--plan-json {tmp_path}/a_file/plan.json cannot be written (File exists: "
                                  f"{tmp_path}/a_file): pass a file path in a folder you can write to.")


def test_one_node_suggestions_stay_accelerate_launch(tmp_path):
    text, _ = dry_run(tmp_path, "qwen27b.yaml", QWEN_27B, "fsdp2_8gpu.yaml", gpu="H100")
    commands = [line.strip() for line in text.splitlines() if "recipes/qwen27b.yaml" in line]
    assert commands and all(c.startswith(".venv/bin/accelerate launch --config_file accelerate_configs/fsdp2_8gpu.yaml "
                                         "scripts/sft.py recipes/qwen27b.yaml ") for c in commands)


def test_gptoss120b_has_one_step_time(tmp_path):
    # the case: 0.52 s in the GPU table and 4.53 s in the communication table for the same run
    text, plan = dry_run(tmp_path, "gptoss120b.yaml", GPT_OSS_120B, "fsdp2_8gpu.yaml", gpu="H100")
    lines = text.splitlines()
    gpu_header = next(line for line in lines if line.startswith("  GPU "))
    assert gpu_header.split()[-1] == "s" and gpu_header.endswith("compute s") and "s/step" not in gpu_header
    h100 = next(line for line in lines if line.startswith("  H100 "))
    own = next(line for line in lines if line.startswith("    FSDP (this)"))
    compute, step = float(own.split()[-6]), float(own.split()[-2])  # compute s NVLink network exposed s/step bound
    assert float(h100.split()[-1]) == pytest.approx(compute, abs=0.006) and step > 4 * compute
    assert "seconds_per_step" not in plan  # the JSON: compute per GPU type, the step only with its communication
    assert plan["compute_seconds_per_step"]["H100"] == pytest.approx(plan["communication"]["compute_seconds"])
    assert plan["communication"]["step_seconds"] == pytest.approx(step, abs=0.0006)


def test_suggestions_leave_the_stated_headroom(tmp_path):
    # 27B at 32k on 8 H100: activation offloading alone leaves 0.3 GiB of 79.6, under the default 2 GiB
    text, plan = dry_run(tmp_path, "qwen27b.yaml", QWEN_27B, "fsdp2_8gpu.yaml", gpu="H100")
    assert plan["memory_headroom_gib"] == 2.0
    assert "each leaving at least 2.0 GiB of 79.6 free (plan_memory_headroom_gib)" in text
    memories = [s["memory_gib"] for s in plan["suggestions"]]
    assert memories and all(m + 2.0 <= 79.6 for m in memories)
    _, tight = dry_run(tmp_path, "qwen27b.yaml", QWEN_27B, "fsdp2_8gpu.yaml", "--plan_memory_headroom_gib", "0",
                       gpu="H100")
    assert max(s["memory_gib"] for s in tight["suggestions"]) > 79.6 - 2.0  # the key is what keeps it out
    with pytest.raises(RecipeError, match="plan_memory_headroom_gib"):
        dry_run(tmp_path, "qwen27b.yaml", QWEN_27B, "fsdp2_8gpu.yaml", "--plan_memory_headroom_gib", "-1")
