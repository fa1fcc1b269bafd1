"""The GPU configs' precision on CPU: every tiny twin under accelerate_configs/fsdp2_cpu_bf16.yaml (fsdp2_8gpu.yaml
with 2 processes), HSDP 2x2 under hsdp_cpu_bf16.yaml (hsdp_2node.yaml on 4 processes), and sequence parallelism
with 2 groups -- bf16 compute, fp32 gradient reduction, fp32 master weights, each twin with its real recipe's
`dtype` and `export_dtype`.

Each run is asserted on several ways: the policy every FSDP2 unit got (the run's `[precision]` line), losses within
LOSS_TOLERANCE of the same run in fp32, resume from a mid-run checkpoint reproducing the later losses exactly, and
the export written in the real recipe's `export_dtype` and checked against the trained model at bf16
(`export_max_logit_diff`). The numbers measured: docs/precision.md.
"""

from __future__ import annotations

import shutil

import pytest
import yaml
from safetensors import safe_open

from conftest import REPO_ROOT, assert_resume_reproduces, launch_sft, read_summary

TINY = REPO_ROOT / "recipes" / "tiny"
CONFIGS = REPO_ROOT / "accelerate_configs"
CPU_BF16, HSDP_CPU_BF16 = CONFIGS / "fsdp2_cpu_bf16.yaml", CONFIGS / "hsdp_cpu_bf16.yaml"
STEPS, SAVE_AT = 4, 2
COMMON = ("--max_steps", str(STEPS), "--save_steps", str(SAVE_AT), "--logging_steps", "1", "--report_to", "none")
BF16 = ("--bf16", "true", "--verify_export", "true")  # the gpt-oss twin, as its recipe, leaves the check off
# |bf16 loss - fp32 loss| per step, over the first 4 steps of the twins at their learning rate (3e-3): measured
# at most 0.012 (docs/precision.md); bf16 rounds to 2^-8 relative, the twins' losses are ~6-12.
LOSS_TOLERANCE = 0.03
# The export check compares the trained (bf16-computing) model with the reload: logit_tolerance's bf16 bound.
EXPORT_TOLERANCE = 5e-2
PRECISION_LINE = ("[precision] bf16 compute, fp32 gradient reduction, fp32 master weights: "
                  "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) on all")


def real_recipe(twin: str) -> dict:
    return yaml.safe_load((REPO_ROOT / "recipes" / f"{twin}.yaml").read_text())


def real_dtypes(twin: str) -> tuple[str, ...]:
    """The real recipe's load dtype (what accelerate upcasts the trainable weights from) and export dtype."""
    real = real_recipe(twin)
    return ("--dtype", real["dtype"], *(("--export_dtype", real["export_dtype"]) if "export_dtype" in real else ()))


def exported_dtypes(output_dir) -> set[str]:
    files = sorted(output_dir.glob("*.safetensors"))
    assert files, output_dir
    dtypes = set()
    for path in files:
        with safe_open(path, "pt") as f:
            dtypes |= {str(f.get_slice(name).get_dtype()) for name in f.keys()}
    return dtypes


def resumed_copy(run_dir, to):
    """`run_dir` as a run preempted after checkpoint-SAVE_AT left it."""
    to.mkdir()
    shutil.copytree(run_dir / f"checkpoint-{SAVE_AT}", to / f"checkpoint-{SAVE_AT}")
    return to


def assert_close_losses(bf16: dict, fp32: dict) -> float:
    assert list(bf16) == list(fp32) == [str(step) for step in range(1, STEPS + 1)]
    worst = max(abs(bf16[step] - fp32[step]) for step in bf16)
    assert worst <= LOSS_TOLERANCE, (bf16, fp32)
    return worst


def assert_bf16_run(result, output_dir) -> dict:
    output = result.stdout + result.stderr
    assert PRECISION_LINE in output, output[-4000:]
    summary = read_summary(output_dir)
    assert summary["export_max_logit_diff"] <= EXPORT_TOLERANCE
    return summary


@pytest.mark.parametrize("cpu, gpu, differences", [
    ("fsdp2_cpu_bf16.yaml", "fsdp2_8gpu.yaml", {"num_processes": (2, 8)}),
    ("hsdp_cpu_bf16.yaml", "hsdp_2node.yaml", {"num_machines": (1, 2), "num_processes": (4, 16),
                                               "parallelism_config_dp_shard_size": (2, 8)})])
def test_the_cpu_copies_differ_from_the_gpu_configs_only_in_the_process_count(cpu, gpu, differences):
    def flat(path):
        values = yaml.safe_load((CONFIGS / path).read_text())
        return {**{k: v for k, v in values.items() if not isinstance(v, dict)},
                **{k: v for section in values.values() if isinstance(section, dict) for k, v in section.items()}}

    ours, theirs = flat(cpu), flat(gpu)
    assert ours.keys() == theirs.keys()
    assert {key: (ours[key], theirs[key]) for key in ours if ours[key] != theirs[key]} == differences
    assert ours["mixed_precision"] == "bf16" and ours["use_cpu"] is False  # gloo is chosen because no GPU is there


# Every twin's resume is checked on flat FSDP here; the Llama twin's on HSDP and SP too, below.
@pytest.mark.fsdp
@pytest.mark.parametrize("twin", ["llama8b", "qwen27b", "qwen27b-vision", "gptoss120b"])
def test_a_twin_under_the_gpu_config_trains_like_fp32_and_exports_in_its_recipes_dtype(tmp_path, twin):
    recipe = TINY / f"{twin}.yaml"
    launch_sft(recipe, *COMMON, "--output_dir", str(tmp_path / "fp32"))
    bf16_args = (*COMMON, *BF16, *real_dtypes(twin))
    result = launch_sft(recipe, *bf16_args, "--output_dir", str(tmp_path / "bf16"), config=CPU_BF16)
    summary = assert_bf16_run(result, tmp_path / "bf16")
    print(f"{twin}: max |bf16 - fp32| loss {assert_close_losses(summary['losses'], read_summary(tmp_path / 'fp32')['losses']):.4g}, "
          f"export logit diff {summary['export_max_logit_diff']:.3g}")
    real = real_recipe(twin)
    if real.get("use_peft"):  # the adapter: LoRA weights are trainable, so fp32 master weights, saved as such
        assert exported_dtypes(tmp_path / "bf16") == {"F32"}
    else:
        assert exported_dtypes(tmp_path / "bf16") == {"BF16"} == {real["export_dtype"].replace("bfloat", "BF")}
    resumed = resumed_copy(tmp_path / "bf16", tmp_path / "resumed")  # steps 3-4 again, from the bf16 run's checkpoint
    assert_bf16_run(launch_sft(recipe, *bf16_args, "--output_dir", str(resumed), config=CPU_BF16), resumed)
    assert_resume_reproduces(tmp_path / "bf16", resumed, SAVE_AT, atol=0.0)


@pytest.mark.fsdp
def test_hsdp_2x2_and_two_sequence_parallel_groups_under_bf16_resume_exactly(tmp_path):
    """The Llama twin: HSDP 2 replicas x 2 shards against flat FSDP over 2 in fp32 (global batch 16 both), and two
    SP groups of 2 on packed chat blocks against the same layout in fp32: losses within LOSS_TOLERANCE, the resumed
    bf16 run's equal to the uninterrupted one's."""
    llama = TINY / "llama8b.yaml"
    packed_sp = ("--global_batch_size", "4", "--per_device_train_batch_size", "2", "--dataset_name",
                 "data/samples/ultrachat.jsonl", "--dataset_format", "messages", "--pack_blocks", "true",
                 "--sequence_parallel_size", "2", "--dataloader_num_workers", "0")
    layouts = {  # name: (arguments, the bf16 launch, the fp32 launch, what the run logs of its layout)
        "hsdp": (("--global_batch_size", "16"), dict(nproc=4, config=HSDP_CPU_BF16), dict(nproc=2),
                 "[mesh] HSDP 2 replicas x 2 shards (dp_replicate x dp_shard) over 4 processes"),
        "sp": (packed_sp, dict(nproc=4, config=CPU_BF16), dict(nproc=4),
               "2 sequence-parallel groups (4 processes / sequence_parallel_size 2)"),
    }
    for name, (args, bf16_launch, fp32_launch, layout_line) in layouts.items():
        launch_sft(llama, *COMMON, *args, "--output_dir", str(tmp_path / f"{name}-fp32"), **fp32_launch)
        bf16_args = (*COMMON, *args, *BF16, *real_dtypes("llama8b"))
        result = launch_sft(llama, *bf16_args, "--output_dir", str(tmp_path / name), **bf16_launch)
        assert layout_line in result.stdout + result.stderr
        summary = assert_bf16_run(result, tmp_path / name)
        worst = assert_close_losses(summary["losses"], read_summary(tmp_path / f"{name}-fp32")["losses"])
        print(f"{name}: max |bf16 - fp32| loss {worst:.4g}, export logit diff {summary['export_max_logit_diff']:.3g}")
        assert exported_dtypes(tmp_path / name) == {"BF16"}
        resumed = resumed_copy(tmp_path / name, tmp_path / f"{name}-resumed")
        assert_bf16_run(launch_sft(llama, *bf16_args, "--output_dir", str(resumed), **bf16_launch), resumed)
        assert_resume_reproduces(tmp_path / name, resumed, SAVE_AT, atol=0.0)


def test_a_policy_other_than_the_one_asked_for_is_found_on_every_unit(single_rank_group):
    """What PrecisionCheck refuses: accelerate's default reduce dtype (bf16), and master weights left in bf16."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from sft_recipes.precision import Precision, model_precision_problems

    asked = Precision(compute=torch.bfloat16, reduce=torch.float32, master=torch.float32)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fully_shard(model[0], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    assert model_precision_problems(model, asked) == (
        ["unit 0 has MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)"], 2)
    model[1].to(torch.bfloat16)
    problems, _ = model_precision_problems(model, asked)
    assert problems[-1] == "trainable parameters are ['torch.bfloat16', 'torch.float32'], not torch.float32"
    assert model_precision_problems(torch.nn.Linear(4, 4), asked) == (["no module of the model is an FSDP2 unit"], 0)
