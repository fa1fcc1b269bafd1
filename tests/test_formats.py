"""The alpaca format reproduces the Llama seed's strings exactly, and padding never reaches the loss."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset

from conftest import reference_recipes
from sft_recipes.data.formats import FORMATS, alpaca_to_prompt_completion
from sft_recipes.loading import load_model, load_tokenizer
from sft_recipes.config import ModelArguments
from sft_recipes.tiny import ensure_tiny


seed_text = reference_recipes().seed000_text  # shared/seeds/000 build_dataset.format_example, verbatim


def test_alpaca_with_input_is_the_seed_string():
    row = {"instruction": "Arrange the following musical notes", "input": "G, B, E", "output": "E, G, B"}
    pc = alpaca_to_prompt_completion(row)
    assert pc == {
        "prompt": "### Instruction:\nArrange the following musical notes\n\n### Input:\nG, B, E\n\n### Response:\n",
        "completion": "E, G, B",
    }


def test_alpaca_without_input_has_no_input_block():
    row = {"instruction": "Give three tips for staying healthy.", "input": "", "output": "1. Eat well."}
    assert alpaca_to_prompt_completion(row)["prompt"] == "### Instruction:\nGive three tips for staying healthy.\n\n### Response:\n"


def test_every_real_alpaca_row_matches_the_seed(realworld):
    path = realworld / "data" / "tatsu-lab__alpaca.stanford_alpaca_pr152_subset300.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert sum(bool(r["input"]) for r in rows) > 50 and sum(not r["input"] for r in rows) > 50
    for row in rows:
        pc = alpaca_to_prompt_completion(row)
        assert pc["prompt"] + pc["completion"] + "</s>" == seed_text(row, "</s>")


def test_missing_column_names_what_is_there():
    with pytest.raises(ValueError, match=r"no column\(s\) \['instruction'\].*it has \['messages', 'output'\]"):
        FORMATS["alpaca"].check_columns(["messages", "output"], "my/data")


@pytest.fixture(scope="module")
def tiny_llama():
    args = ModelArguments(model_name_or_path=ensure_tiny("llama"), dtype="float32")
    return load_tokenizer(args), load_model(args)


def collate_through_trl(tiny_llama, rows, tmp_path, completion_only_loss):
    from trl import SFTConfig, SFTTrainer

    tokenizer, model = tiny_llama
    dataset = Dataset.from_list([alpaca_to_prompt_completion(r) for r in rows])
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], max_length=128,
                     completion_only_loss=completion_only_loss, activation_checkpointing=False)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    examples = [trainer.train_dataset[i] for i in range(len(rows))]
    return tokenizer, trainer.data_collator(examples)


ROWS = [
    {"instruction": "Add 2 and 3.", "input": "", "output": "5"},
    {"instruction": "Arrange the following musical notes", "input": "G, B, E", "output": "E, G, B"},
    {"instruction": "Say hi.", "input": "", "output": "Hi there, nice to meet you."},
]


def test_padding_is_never_in_the_labels(tiny_llama, tmp_path):
    tokenizer, batch = collate_through_trl(tiny_llama, ROWS, tmp_path, completion_only_loss=False)
    assert tokenizer.pad_token == tokenizer.eos_token  # the seed's pad = eos, as in the recipe
    padded = batch["attention_mask"] == 0
    assert padded.any(), "the rows differ in length, so the batch must be padded"
    assert torch.equal(batch["labels"] == -100, padded), "labels are -100 exactly on padding"
    for row, ids, mask in zip(ROWS, batch["input_ids"], batch["attention_mask"]):
        text = tokenizer.decode(ids[mask.bool()])
        assert text == tokenizer.bos_token + seed_text(row, tokenizer.eos_token)  # one eos, trained on


def test_completion_only_loss_masks_the_prompt_too(tiny_llama, tmp_path):
    tokenizer, batch = collate_through_trl(tiny_llama, ROWS, tmp_path, completion_only_loss=True)
    for row, ids, labels in zip(ROWS, batch["input_ids"], batch["labels"]):
        supervised = tokenizer.decode(ids[labels != -100])
        assert supervised == row["output"] + tokenizer.eos_token
