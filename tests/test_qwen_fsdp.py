"""The tiny Qwen3.5 twin trains packed under 2-process FSDP2 on CPU; uneven shards stop together."""

from __future__ import annotations

import re

import json
import shutil

import pytest
import torch
import yaml
from datasets import load_dataset
from torch.utils.data import DataLoader
from safetensors import safe_open

from conftest import (
    CPU_CONFIG, HSDP_CPU_CONFIG, REPO_ROOT, assert_resume_reproduces, launch_sft, read_summary, write_uneven_shards,
)
from sft_recipes.data.blocks import RankLocalBlockStream, collate_blocks
from sft_recipes.data.collator import BlockDiagonalCollator
from sft_recipes.loading import load_tokenizer
from sft_recipes.config import ModelArguments
from sft_recipes.tiny import ensure_tiny

pytestmark = pytest.mark.fsdp

RECIPE = REPO_ROOT / "recipes" / "tiny" / "qwen27b.yaml"
SAVE_EVERY = 20


@pytest.fixture(scope="module")
def packed_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen") / "run"
    result = launch_sft(RECIPE, "--output_dir", str(out), "--report_to", "none", "--save_steps", str(SAVE_EVERY))
    return out, result


def test_packed_qwen3_5_trains_with_falling_loss_and_stops_when_data_ends(packed_run):
    out, result = packed_run
    summary = read_summary(out)
    assert summary["distributed"] == "FSDP2 over 2 process(es) on cpu"
    assert result.stderr.count("packing preflight passed for qwen3_5") == 1  # once: by the main process
    # transformers' advice to install causal-conv1d, once per kernel on every rank: one line, by the main process
    assert "falling back to its reference PyTorch implementation" not in result.stderr
    assert result.stderr.count("[kernels] causal_conv1d is not installed (GPU kernels)") == 1
    losses = list(summary["losses"].values())
    assert losses[-1] < losses[0] - 1.5, losses
    assert 10 < summary["steps"] < 100000  # one pass over the sample data, not max_steps
    assert summary["packing_efficiency"] > 0.95  # split_examples: every block but the last is full


def test_export_keeps_the_vision_tower_and_the_class(packed_run):
    out, _ = packed_run
    source = ensure_tiny("qwen3_5")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    with safe_open(f"{source}/model.safetensors", "pt") as before, safe_open(f"{out}/model.safetensors", "pt") as after:
        assert set(after.keys()) == set(before.keys())
        assert any("visual" in key for key in after.keys())
        vision = next(key for key in after.keys() if "visual" in key and key.endswith("weight"))
        # Text-only SFT never updates the vision tower, but it must come back unchanged, not dropped.
        assert torch.equal(after.get_tensor(vision), before.get_tensor(vision))
    assert read_summary(out)["export_max_logit_diff"] <= 1e-4


@pytest.mark.parametrize("nproc, config", [(2, CPU_CONFIG), (4, HSDP_CPU_CONFIG)], ids=["flat2", "hsdp2x2"])
def test_uneven_shards_stop_on_the_same_step(tmp_path, nproc, config):
    # Each rank x the recipe's dataloader workers, each reader with its own shard of one streamed file.
    workers = yaml.safe_load(RECIPE.read_text())["dataloader_num_workers"]
    assert workers > 1, "the tiny twin must exercise dataloader workers, like the real recipe"
    data = write_uneven_shards(tmp_path / "uneven.jsonl", rows=24 * nproc)
    tokenizer = load_tokenizer(ModelArguments(model_name_or_path=ensure_tiny("qwen3_5")))
    raw = load_dataset("json", data_files=str(data), split="train", streaming=True)
    first_exhausted = []
    for rank in range(nproc):
        stream = RankLocalBlockStream(raw, tokenizer, max_length=256, rank=rank, world_size=nproc)
        first_exhausted.append(_first_exhausted_batch(stream, workers, tokenizer.pad_token_id))
    assert first_exhausted[0] > first_exhausted[1] + 2, first_exhausted  # deliberately uneven
    out = tmp_path / "run"
    launch_sft(RECIPE, "--dataset_name", str(data), "--output_dir", str(out), "--report_to", "none",
               nproc=nproc, config=config)
    # A rank with the short rows runs out first: every rank stops right after the step in which it noticed, no
    # hang, in either replica under HSDP (one block per step in the twin).
    assert read_summary(out)["steps"] == min(first_exhausted) + 1


def _first_exhausted_batch(stream, workers: int, pad_token_id: int) -> int:
    collate = collate_blocks(BlockDiagonalCollator(max_length=256, pad_token_id=pad_token_id))
    for index, batch in enumerate(DataLoader(stream, batch_size=1, num_workers=workers, collate_fn=collate)):
        if batch["stream_exhausted"].item():
            return index
        assert index < 1000, "a block stream never ends on its own"


def test_resume_of_the_packed_stream_is_exact(packed_run, tmp_path):
    """Model, optimizer and the position in the streamed, packed data all come back."""
    out, _ = packed_run
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(out / f"checkpoint-{SAVE_EVERY}", resumed / f"checkpoint-{SAVE_EVERY}")
    launch_sft(RECIPE, "--output_dir", str(resumed), "--report_to", "none", "--save_steps", str(SAVE_EVERY))
    assert_resume_reproduces(out, resumed, SAVE_EVERY, atol=1e-4)


def test_a_stream_with_nothing_to_learn_fails_on_every_rank(tmp_path):
    data = tmp_path / "questions_only.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n" for i in range(8)))
    out = tmp_path / "run"
    result = launch_sft(RECIPE, "--dataset_name", str(data), "--output_dir", str(out), "--report_to", "none",
                        check=False)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: Refusing to go on"), result.stderr[-3000:]
    # torchrun's report: every rank refused (2) or was stopped by torchrun once the first one had (SIGTERM)
    codes = re.findall(r"exitcode  : (-?\d+)", result.stderr)
    assert "2" in codes and set(codes) <= {"2", "-15"}, codes
    assert not list(out.glob("checkpoint-*")) and not (out / "model.safetensors").exists()


def test_two_processes_train_like_one_on_the_same_global_batch(tmp_path):
    """Plain FSDP2 on the VLM class: 2 processes log 1 process's losses on the same global batches.

    Before `sft_recipes.fsdp_wrap.group_output_head_with_final_norm`, step 1 matched and step 2 did not
    (5.9423 against 5.9324): each rank's lm_head shard kept only its own rank's gradient.
    """
    # Map-style rows and padded batches: the rows of each step do not depend on the world size.
    common = ("--dataset_streaming", "false", "--pack_blocks", "false", "--max_steps", "3", "--logging_steps", "1",
              "--report_to", "none", "--save_steps", "1000", "--global_batch_size", "4")
    launch_sft(RECIPE, *common, "--output_dir", str(tmp_path / "one"), nproc=1)
    launch_sft(RECIPE, *common, "--output_dir", str(tmp_path / "two"))
    one, two = (read_summary(tmp_path / name)["losses"] for name in ("one", "two"))
    assert list(two) == list(one) == ["1", "2", "3"]
    for step, loss in two.items():
        assert loss == pytest.approx(one[step], abs=1e-4), step
