"""Shard-by-shard LoRA merge: the update math by hand, against peft's merge_and_unload, and the CLI."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import REPO_ROOT
from sft_recipes import merge
from sft_recipes.config import load_recipe
from sft_recipes.errors import one_line_refusals
from sft_recipes.lora import apply_lora, build_lora_config
from sft_recipes.merge import LoraUpdate, merge_checkpoint, merged_weight
from sft_recipes.tiny import ensure_tiny

TWIN = REPO_ROOT / "recipes" / "tiny" / "gptoss120b.yaml"


def expert_update(scaling: float, experts: int = 2, in_out: bool = True) -> LoraUpdate:
    return LoraUpdate("x.experts.gate_up_proj", "a", "b", scaling, experts, in_out)


def test_expert_update_by_hand_rank_1():
    lora_a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # [E*r, in]: expert 0's row, then expert 1's
    lora_b = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # [out, r*E]: column e for rank 1
    merged = merged_weight(torch.zeros(2, 2, 3), lora_a, lora_b, expert_update(2.0), torch.float32)
    # expert 0: 2 * ([1, 0, 1] x [1, 2]) = [[2, 4], [0, 0], [2, 4]], stored [in, out]
    assert merged.tolist() == [[[2.0, 0.0, 2.0], [4.0, 0.0, 4.0]], [[0.0, 6.0, 6.0], [0.0, 8.0, 8.0]]]


def test_expert_update_by_hand_rank_2_interleaves_lora_b_columns():
    lora_a = torch.tensor([[1.0], [2.0], [3.0], [4.0]])  # rows: e0 j0, e0 j1, e1 j0, e1 j1
    lora_b = torch.tensor([[10.0, 20.0, 30.0, 40.0]])  # columns: j0 e0, j0 e1, j1 e0, j1 e1
    merged = merged_weight(torch.ones(2, 1, 1), lora_a, lora_b, expert_update(1.0), torch.float32)
    assert merged.tolist() == [[[1.0 + 10 * 1 + 30 * 2]], [[1.0 + 20 * 3 + 40 * 4]]]


def test_linear_update_by_hand_is_rounded_once_to_bf16():
    update = LoraUpdate("q_proj.weight", "a", "b", 0.5, 1, False)
    merged = merged_weight(torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0, 4.0]]), torch.tensor([[1.0]]), update,
                           torch.bfloat16)
    assert merged.dtype == torch.bfloat16 and merged.tolist() == [[2.0, 3.0]]


@pytest.fixture(scope="module")
def trained_adapter(tmp_path_factory):
    """A tiny GPT-OSS adapter with random non-zero LoRA weights (as if trained), and its peft model."""
    model_args = load_recipe(TWIN).model
    base_dir = ensure_tiny("gpt_oss")
    peft_model = apply_lora(AutoModelForCausalLM.from_pretrained(base_dir), build_lora_config(model_args), seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if param.requires_grad:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    adapter_dir = tmp_path_factory.mktemp("adapter")
    peft_model.save_pretrained(adapter_dir)
    return base_dir, adapter_dir, peft_model


def test_merge_equals_peft_merge_and_unload(trained_adapter, tmp_path):
    base_dir, adapter_dir, peft_model = trained_adapter
    report = merge_checkpoint(base_dir, adapter_dir, tmp_path / "merged", torch.float32)
    assert (report.merged, report.expert_stacks, report.shards) == (12, 4, 1)
    ours = load_file(tmp_path / "merged" / "model.safetensors")
    theirs = {k: v.detach() for k, v in _peft_merged(peft_model).state_dict().items()}
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert torch.allclose(ours[name], tensor, atol=1e-6), name
    experts = "model.layers.1.mlp.experts.gate_up_proj"
    base = load_file(f"{base_dir}/model.safetensors")
    assert not torch.allclose(ours[experts], base[experts])  # the experts really were merged


def test_merge_works_shard_by_shard(trained_adapter, tmp_path):
    base_dir, adapter_dir, _ = trained_adapter
    sharded_base = tmp_path / "sharded-base"
    AutoModelForCausalLM.from_pretrained(base_dir).save_pretrained(sharded_base, max_shard_size="400KB")
    shards = sorted(p.name for p in sharded_base.glob("*.safetensors"))
    assert len(shards) >= 3
    report = merge_checkpoint(sharded_base, adapter_dir, tmp_path / "merged-sharded", torch.float32)
    merge_checkpoint(base_dir, adapter_dir, tmp_path / "merged-single", torch.float32)
    assert report.shards == len(shards)
    assert sorted(p.name for p in (tmp_path / "merged-sharded").glob("*.safetensors")) == shards
    index = json.loads((tmp_path / "merged-sharded" / "model.safetensors.index.json").read_text())
    single = load_file(tmp_path / "merged-single" / "model.safetensors")
    assert set(index["weight_map"]) == set(single)
    sharded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged-sharded").state_dict()
    for name, tensor in single.items():
        assert torch.equal(sharded[name], tensor), name


def test_merge_refuses_an_adapter_for_another_base(trained_adapter, tmp_path):
    base_dir, adapter_dir, _ = trained_adapter
    other_base = tmp_path / "other"
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    state = {k: v for k, v in model.state_dict().items() if "experts.down_proj" not in k}
    model.save_pretrained(other_base, state_dict=state)
    with pytest.raises(ValueError, match=r"2 LoRA target\(s\) are not in the base checkpoint .*--base"):
        merge_checkpoint(other_base, adapter_dir, tmp_path / "merged", torch.float32)


def load_merge_script():
    spec = importlib.util.spec_from_file_location("merge_lora", REPO_ROOT / "scripts" / "merge_lora.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_writes_a_verified_bf16_model(trained_adapter, tmp_path, capsys):
    base_dir, adapter_dir, peft_model = trained_adapter
    out_dir = tmp_path / "merged"
    assert load_merge_script().main([str(adapter_dir), str(out_dir)]) == 0
    assert "[merge] verified: max |logit diff| merged vs base+adapter" in capsys.readouterr().out
    merged = AutoModelForCausalLM.from_pretrained(out_dir)  # plain transformers, no peft
    assert merged.dtype == torch.bfloat16 and "quantization_config" not in json.loads((out_dir / "config.json").read_text())
    assert (out_dir / "tokenizer.json").is_file()


def test_cli_refuses_wrong_folders_and_options_in_one_line(trained_adapter, tmp_path, capsys):
    base_dir, adapter_dir, _ = trained_adapter
    script, missing, taken = load_merge_script(), tmp_path / "nope", tmp_path / "taken"
    taken.mkdir()
    other_base = tmp_path / "other"
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    model.save_pretrained(other_base, state_dict={k: v for k, v in model.state_dict().items()
                                                  if "experts.down_proj" not in k})
    capsys.readouterr()  # the progress bars of making the other base
    refusals = {
        (str(missing), str(tmp_path / "m1")): f"error: {missing} is not a folder here: pass the output_dir of a "
                                               "finished run",
        (str(base_dir), str(tmp_path / "m2")): f"error: {base_dir} holds no LoRA adapter (no adapter_config.json; a "
                                                "full fine-tune's export needs no merge): pass the output_dir of a "
                                                "finished run",
        (str(adapter_dir), str(taken)): f"error: {taken} exists: choose a new OUT_DIR.",
    }
    for args, line in refusals.items():
        assert one_line_refusals(lambda: script.main(list(args))) == 2
        assert capsys.readouterr().err == line + "\n"
    assert one_line_refusals(lambda: script.main([str(adapter_dir), str(tmp_path / "m3"), "--base",
                                                  str(other_base)])) == 2
    assert re.fullmatch(r"error: 2 LoRA target\(s\) are not in the base checkpoint .*--base.*\n",
                        capsys.readouterr().err)
    with pytest.raises(SystemExit) as refused:
        script.main([str(adapter_dir), str(tmp_path / "m4"), "--dtype", "float16"])
    assert (refused.value.code, capsys.readouterr().err) == (
        2, "error: argument --dtype: invalid choice: 'float16' (choose from 'bfloat16', 'float32') "
           "(see scripts/merge_lora.py --help)\n")
    assert not any(tmp_path.glob("m[1-4]*"))


def test_cli_rejects_a_merge_that_does_not_reproduce_the_adapter(trained_adapter, tmp_path, monkeypatch, capsys):
    base_dir, adapter_dir, _ = trained_adapter
    monkeypatch.setattr(merge, "merged_weight", lambda weight, a, b, update, dtype: weight.to(dtype))  # drops the updates
    out_dir = tmp_path / "merged"
    assert load_merge_script().main([str(adapter_dir), str(out_dir), "--dtype", "float32"]) == 1
    assert "does not reproduce base + adapter" in capsys.readouterr().err
    assert not out_dir.exists() and (tmp_path / "merged.incomplete").is_dir()


def _peft_merged(peft_model):
    """peft's own merge, on a copy (merge_and_unload modifies the model in place)."""
    import copy

    return copy.deepcopy(peft_model).merge_and_unload()


def test_an_update_that_does_not_fit_the_weight_is_an_error():
    lora_a, lora_b = torch.ones(2, 2), torch.ones(3, 2)  # 2 experts, rank 1: update [2, in 2, out 3]
    mismatch = r"update of x.experts.gate_up_proj has shape \[2, 2, 3\] but the base weight is \[2, 3, 2\]"
    with pytest.raises(ValueError, match=mismatch):
        merged_weight(torch.zeros(2, 3, 2), lora_a, lora_b, expert_update(1.0), torch.float32)
