"""The GPT-OSS LoRA recipe under FSDP2: wrap classes, the LoRA layout guard, and real 2-process runs.

The runs (tiny twin, `accelerate launch`, 2 CPU processes over gloo) train LoRA on attention and on
the expert parameters, checkpoint at step 2 and 4, export the adapter, then resume from step 2;
the merge tool runs on the result. A third run loads like the GPU config does: an MXFP4 base,
dequantized to bf16, read by rank 0 alone and broadcast (fsdp_cpu_ram_efficient_loading).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import yaml
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from conftest import (
    CPU_CONFIG, REPO_ROOT, assert_resume_reproduces, bin_path, free_port, launch_sft, read_summary, run_command,
)
from sft_recipes.config import load_recipe
from sft_recipes.fsdp_wrap import (
    WRAP_CLASSES_ENV,
    check_lora_fsdp_layout,
    guard_lora_fsdp_layout,
    pin_fsdp_wrap_classes,
    resolve_fsdp_wrap_classes,
)
from sft_recipes.lora import applied_lora, apply_lora, build_lora_config, load_adapter
from sft_recipes.tiny import ensure_tiny
from test_mxfp4 import write_mxfp4_checkpoint

TWIN = REPO_ROOT / "recipes" / "tiny" / "gptoss120b.yaml"
STEPS, SAVE_EVERY = 4, 2
COMMON = ["--max_steps", str(STEPS), "--save_steps", str(SAVE_EVERY), "--verify_export", "true"]
DECODER_LAYER = ["GptOssDecoderLayer"]


def tiny_gpt_oss() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(ensure_tiny("gpt_oss"))


# ── Wrap classes ──────────────────────────────────────────────────────────────────────────────


def test_wrap_class_comes_from_the_model(monkeypatch):
    monkeypatch.delenv(WRAP_CLASSES_ENV, raising=False)
    assert resolve_fsdp_wrap_classes(tiny_gpt_oss()) == ["GptOssDecoderLayer"]


def test_recipe_then_accelerate_config_may_name_other_classes(monkeypatch):
    model = tiny_gpt_oss()
    monkeypatch.setenv(WRAP_CLASSES_ENV, "GptOssAttention")
    assert resolve_fsdp_wrap_classes(model) == ["GptOssAttention"]
    assert resolve_fsdp_wrap_classes(model, ["GptOssMLP"]) == ["GptOssMLP"]
    assert pin_fsdp_wrap_classes(model, ["GptOssMLP", "GptOssDecoderLayer"]) == ["GptOssMLP", "GptOssDecoderLayer"]
    assert os.environ[WRAP_CLASSES_ENV] == "GptOssMLP,GptOssDecoderLayer"  # what accelerate's FSDP plugin reads


def test_a_class_not_in_the_model_is_an_error_naming_those_that_are(monkeypatch):
    monkeypatch.delenv(WRAP_CLASSES_ENV, raising=False)
    with pytest.raises(ValueError, match=r"\['LlamaDecoderLayer'\] from the recipe's fsdp_wrap_classes are not in "
                                         r"GptOssForCausalLM; its module classes are: .*GptOssDecoderLayer"):
        resolve_fsdp_wrap_classes(tiny_gpt_oss(), ["LlamaDecoderLayer"])
    monkeypatch.setenv(WRAP_CLASSES_ENV, "MistralDecoderLayer")
    with pytest.raises(ValueError, match="from the accelerate config's fsdp_transformer_layer_cls_to_wrap"):
        resolve_fsdp_wrap_classes(tiny_gpt_oss())


# ── LoRA layout guard (one process, gloo) ─────────────────────────────────────────────────────


def sharded_lora_model(extra_units=()) -> torch.nn.Module:
    """Tiny GPT-OSS + the recipe's LoRA, sharded per decoder layer (accelerate's layout) plus `extra_units`."""
    model = apply_lora(tiny_gpt_oss(), build_lora_config(load_recipe(TWIN).model), seed=0)
    layers = model.base_model.model.model.layers
    for path in extra_units:  # bottom-up, as auto-wrap policies shard
        fully_shard(model.get_submodule(path))
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def forward_backward(model) -> None:
    tokens = torch.tensor([[5, 17, 42, 8, 99, 3]])
    model(input_ids=tokens, labels=tokens).loss.backward()


def test_decoder_layer_units_hold_every_lora_parameter(single_rank_group):
    model = sharded_lora_model()
    assert check_lora_fsdp_layout(model, DECODER_LAYER) == 24
    forward_backward(model)


EXPERT_LORA_A = "base_model.model.model.layers.0.mlp.experts.lora_A.default"  # down_proj's ParamWrapper


def test_a_lora_leaf_sharded_on_its_own_is_refused(single_rank_group):
    model = sharded_lora_model(extra_units=[EXPERT_LORA_A])
    with pytest.raises(RuntimeError, match=rf"1 LoRA parameter\(s\) are not sharded with their GptOssDecoderLayer: "
                                           rf"{EXPERT_LORA_A}.weight is in FSDP unit '{EXPERT_LORA_A}'.*peft#3080"):
        check_lora_fsdp_layout(model, DECODER_LAYER)


def test_the_guard_stops_the_first_step_before_peft_fails(single_rank_group):
    # Without the guard, ParamWrapper reads the never-gathered lora_A and the forward breaks (peft#3080).
    broken = sharded_lora_model(extra_units=[EXPERT_LORA_A])
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        forward_backward(broken)
    guarded = sharded_lora_model(extra_units=[EXPERT_LORA_A])
    guard_lora_fsdp_layout(guarded, DECODER_LAYER)
    with pytest.raises(RuntimeError, match="Unsafe FSDP layout for LoRA"):
        forward_backward(guarded)


def test_a_model_without_units_for_its_layers_is_refused(single_rank_group):
    model = apply_lora(tiny_gpt_oss(), build_lora_config(load_recipe(TWIN).model), seed=0)
    fully_shard(model)  # one unit: what a wrap policy that matched nothing leaves
    with pytest.raises(RuntimeError, match=r"24 LoRA parameter\(s\).*is in FSDP unit '<root>'"):
        check_lora_fsdp_layout(model, DECODER_LAYER)


# ── Real runs: 2 processes, FSDP2 over gloo ───────────────────────────────────────────────────


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptoss")
    run = launch_sft(TWIN, *COMMON, "--output_dir", str(root / "run"))
    resumed_dir = root / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(root / "run" / f"checkpoint-{SAVE_EVERY}", resumed_dir / f"checkpoint-{SAVE_EVERY}")
    resumed = launch_sft(TWIN, *COMMON, "--output_dir", str(resumed_dir))
    merge = run_command([bin_path("python"), "scripts/merge_lora.py", str(root / "run"), str(root / "merged"),
                         "--dtype", "float32"])
    return {"root": root, "run": run, "resumed": resumed, "merge": merge, "mxfp4": launch_like_gpus(root)}


def launch_like_gpus(root):
    """The real recipe's loading: an MXFP4 base dequantized to bf16, read by rank 0 only and broadcast."""
    write_mxfp4_checkpoint(root / "mxfp4-base")
    config = yaml.safe_load(CPU_CONFIG.read_text())
    config["fsdp_config"].update(fsdp_cpu_ram_efficient_loading=True, fsdp_sync_module_states=True)
    (root / "rank0_loading.yaml").write_text(yaml.safe_dump(config))
    cmd = [bin_path("accelerate"), "launch", "--config_file", str(root / "rank0_loading.yaml"), "--num_processes", "2",
           "--main_process_port", str(free_port()), "scripts/sft.py", str(TWIN), *COMMON, "--dtype", "bfloat16",
           "--model_name_or_path", str(root / "mxfp4-base"), "--output_dir", str(root / "mxfp4-run")]
    return run_command(cmd)


def adapter(path) -> dict[str, torch.Tensor]:
    return load_file(path / "adapter_model.safetensors")


@pytest.mark.fsdp
def test_lora_on_experts_trains_under_fsdp2(runs):
    summary = read_summary(runs["root"] / "run")
    assert summary["distributed"] == "FSDP2 over 2 process(es) on cpu"
    assert list(summary["losses"]) == [str(step) for step in range(1, STEPS + 1)]
    log = runs["run"].stderr
    assert "FSDP layout: all 24 LoRA parameters are sharded with their GptOssDecoderLayer" in log
    assert "model.layers.*.mlp.experts.gate_up_proj  r=8   alpha=32   x2 (4 experts" in log
    assert log.count("LoRA applied:") == 1  # by the main process: the table was printed by every rank
    assert "did not match any targeted module" not in log  # peft's false rank_pattern warning


@pytest.mark.fsdp
def test_every_lora_tensor_changed_with_the_recipe_ranks(runs):
    recipe = load_recipe(TWIN)
    untrained = get_peft_model_state_dict(apply_lora(tiny_gpt_oss(), build_lora_config(recipe.model), seed=recipe.training.seed))
    trained = adapter(runs["root"] / "run")
    assert set(trained) == set(untrained) and len(trained) == 24
    unchanged = [name for name, tensor in trained.items() if torch.equal(tensor, untrained[name])]
    assert unchanged == []
    reloaded = load_adapter(tiny_gpt_oss(), runs["root"] / "run")
    ranks = {lora.target.split(".", 3)[-1]: lora.rank for lora in applied_lora(reloaded)}
    assert ranks == {"self_attn.q_proj": 32, "self_attn.k_proj": 32, "self_attn.v_proj": 32, "self_attn.o_proj": 32,
                     "mlp.experts.gate_up_proj": 8, "mlp.experts.down_proj": 8}


@pytest.mark.fsdp
def test_make_show_loads_the_adapter_onto_its_base_and_refuses_a_folder_without_a_run(runs, tmp_path):
    out = runs["root"] / "run"
    shown = run_command([bin_path("python"), "scripts/show_run.py", str(out)])
    assert shown.returncode == 0, shown.stderr[-3000:]
    diff = read_summary(out)["export_max_logit_diff"]
    assert (f"  checkpoint         {out}/ (adapter_model.safetensors, adapter_config.json, tokenizer)\n"
            "  reloaded as        GptOssForCausalLM + its LoRA adapter (peft)\n"
            "  export check       passed: the reloaded export reproduces the trained model's logits (max abs "
            f"difference {diff:.3g})\n") in shown.stdout, shown.stdout[-3000:]
    refused = run_command([bin_path("python"), "scripts/show_run.py", str(tmp_path)])
    assert (refused.returncode, refused.stderr.strip().splitlines()[-1]) == (
        2, f"error: {tmp_path} holds no finished run (no readable run_summary.json and export): pass a run's "
           "output_dir, e.g. make show OUT=outputs/demo")


@pytest.mark.fsdp
def test_exported_adapter_is_the_trained_one(runs, tmp_path):
    # In the run: fresh single-process base + saved adapter reproduced the sharded model's logits,
    # which also shows no frozen weight moved.
    assert read_summary(runs["root"] / "run")["export_max_logit_diff"] <= 1e-5
    # Bit for bit: the adapter equals the weights the trainer checkpointed at the last step.
    dcp_to_torch_save(runs["root"] / "run" / f"checkpoint-{STEPS}" / "pytorch_model_fsdp_0", tmp_path / "last.pt")
    checkpointed = torch.load(tmp_path / "last.pt")["model"]  # accelerate saves {"model": adapter state}
    exported = adapter(runs["root"] / "run")
    assert set(checkpointed) == set(exported)
    for name, tensor in exported.items():
        assert torch.equal(checkpointed[name], tensor), name


@pytest.mark.fsdp
def test_resume_from_a_checkpoint_continues_the_same_run(runs):
    assert_resume_reproduces(runs["root"] / "run", runs["root"] / "resumed", SAVE_EVERY, atol=1e-5)
    original, again = adapter(runs["root"] / "run"), adapter(runs["root"] / "resumed")
    for name, tensor in original.items():
        assert torch.allclose(again[name], tensor, atol=1e-6), name


@pytest.mark.fsdp
def test_merged_export_matches_the_adapter_model(runs):
    assert runs["merge"].returncode == 0, runs["merge"].stderr[-3000:]
    assert "[merge] verified" in runs["merge"].stdout
    probe = torch.tensor([[0, 20, 31, 47, 5, 99, 120, 7, 64, 3, 250, 401]])
    merged = AutoModelForCausalLM.from_pretrained(runs["root"] / "merged").eval()
    adapted = PeftModel.from_pretrained(tiny_gpt_oss(), str(runs["root"] / "run")).eval()
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=probe).logits, adapted(input_ids=probe).logits, atol=1e-5)


@pytest.mark.fsdp
def test_mxfp4_base_trains_when_rank_0_alone_loads_it(runs):
    """fsdp2_8gpu.yaml's loading (cpu_ram_efficient_loading) on the MXFP4 checkpoint, in bf16."""
    assert runs["mxfp4"].returncode == 0, runs["mxfp4"].stderr[-4000:]
    summary = read_summary(runs["root"] / "mxfp4-run")
    assert summary["distributed"] == "FSDP2 over 2 process(es) on cpu" and summary["steps"] == STEPS
    # Rank 0 dequantized the base again, added the saved adapter: the sharded model's logits, in bf16.
    assert summary["export_max_logit_diff"] == pytest.approx(0.0, abs=1e-3)
    trained = adapter(runs["root"] / "mxfp4-run")
    assert len(trained) == 24 and all(tensor.dtype == torch.float32 for tensor in trained.values())


@pytest.mark.fsdp
def test_every_checkpoint_holds_a_loadable_peft_adapter(runs):
    final = adapter(runs["root"] / "run")
    for step in (SAVE_EVERY, STEPS):
        saved = runs["root"] / "run" / f"checkpoint-{step}" / "adapter"
        assert (saved / "adapter_config.json").is_file()
        assert set(adapter(saved)) == set(final)
    mid = adapter(runs["root"] / "run" / f"checkpoint-{SAVE_EVERY}" / "adapter")
    last = adapter(runs["root"] / "run" / f"checkpoint-{STEPS}" / "adapter")
    assert all(torch.equal(last[name], final[name]) for name in final)  # the last checkpoint is the export
    assert any(not torch.equal(mid[name], final[name]) for name in final)  # trained on after the mid checkpoint
