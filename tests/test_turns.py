"""Which assistant turns train: a message's own `train: false` / `weight: 0`, and `train_turns: last`
(LLaMA-Factory's mask_history), exact on the real Llama-3.1 template and shown by the mask audit."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml
from datasets import Dataset

from real_tokenizers import real_tokenizer
from sft_recipes.config import load_recipe
from sft_recipes.data.audit import audit_dataset, format_report
from sft_recipes.data.formats import FORMATS
from sft_recipes.data.masking import KEPT, NO_TRAINED_TURN, mask_conversations
from sft_recipes.data.rows import INVALID_TRAIN_FLAG
from sft_recipes.data.sources import load_checked_dataset
from sft_recipes.errors import RecipeError
from test_masking import runs

CHAT = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "Check again."},
    {"role": "assistant", "content": "4"},
]


@pytest.fixture(scope="module")
def llama():
    return real_tokenizer("llama")


@pytest.mark.parametrize("flag", [{"train": False}, {"weight": 0}])
def test_a_flagged_turn_stays_in_the_context_out_of_the_loss(llama, flag):
    flagged = [CHAT[0], {**CHAT[1], **flag}, *CHAT[2:]]
    (row,) = mask_conversations(llama, [flagged])
    (plain,) = mask_conversations(llama, [CHAT])
    assert row.input_ids == plain.input_ids  # the template never sees the flag
    assert runs(llama, row.input_ids, row.assistant_masks) == ["4<|eot_id|>"]
    assert runs(llama, plain.input_ids, plain.assistant_masks) == ["5<|eot_id|>", "4<|eot_id|>"]
    assert (row.drop_reason, row.untrained_turns, len(row.turns)) == (KEPT, 1, 1)


def test_a_conversation_with_every_turn_flagged_is_dropped(llama):
    (row,) = mask_conversations(llama, [[CHAT[0], {**CHAT[1], "train": False}]])
    assert row.drop_reason == NO_TRAINED_TURN


def test_flags_other_than_true_false_or_weight_0_1_are_row_drops():
    fmt = FORMATS["messages"]
    assert fmt.row_problem({"messages": [CHAT[0], {**CHAT[1], "train": False}, *CHAT[2:]]}) is None
    assert fmt.row_problem({"messages": [CHAT[0], {**CHAT[1], "weight": 1}, *CHAT[2:]]}) is None
    assert fmt.row_problem({"messages": [CHAT[0], {**CHAT[1], "train": "no"}, *CHAT[2:]]}) == INVALID_TRAIN_FLAG
    assert fmt.row_problem({"messages": [CHAT[0], {**CHAT[1], "weight": 0.5}, *CHAT[2:]]}) == INVALID_TRAIN_FLAG


def test_a_flag_of_the_other_json_type_is_a_row_drop_not_a_turn_trained_silently(tmp_path):
    # `train: 0` passed as False (0 == False) yet trained (the masking keeps only `train: false` out of the loss),
    # and a file with `false` in one row and `0` in another was an Arrow traceback
    rows = [[CHAT[0], {**CHAT[1], "train": False}, *CHAT[2:]], [CHAT[0], {**CHAT[1], "train": 0}, *CHAT[2:]],
            [CHAT[0], {**CHAT[1], "weight": 0}, *CHAT[2:]], [CHAT[0], {**CHAT[1], "weight": False}, *CHAT[2:]],
            [CHAT[0], {**CHAT[1], "weight": 0.0}, *CHAT[2:]], [CHAT[0], {**CHAT[1], "train": 1}, *CHAT[2:]]]
    path = tmp_path / "flags.jsonl"
    path.write_text("".join(json.dumps({"messages": row}) + "\n" for row in rows))
    dataset, report = load_checked_dataset(SimpleNamespace(
        dataset_name=str(path), dataset_format="messages", dataset_streaming=False, max_train_samples=None))
    assert dict(report.dropped) == {INVALID_TRAIN_FLAG: 3}
    assert [(messages[1]["train"], messages[1]["weight"]) for messages in dataset["messages"]] == [
        (False, None), (None, 0), (None, 0)]  # Arrow fills the key a row lacks with null


def test_train_turns_last_trains_each_conversations_last_reply_and_the_audit_says_so(llama):
    rows = Dataset.from_list([{"messages": CHAT}, {"messages": CHAT[:2]}])
    audit = audit_dataset(FORMATS["messages"].rows_to_train(rows, "last"), llama, n=2)
    assert [example.marked_text.count("[[") for example in audit.examples] == [1, 1]
    assert audit.examples[0].marked_text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n5<|eot_id|>"
                                                   "<|start_header_id|>user<|end_header_id|>\n\nCheck again.<|eot_id|>"
                                                   "<|start_header_id|>assistant<|end_header_id|>\n\n[[4<|eot_id|>]]")
    assert (audit.assistant_turns, audit.untrained_turns) == (2, 1)
    assert "assistant turns kept out of the loss (train: false, weight: 0 or train_turns: last): 1" in format_report(audit)
    every = audit_dataset(FORMATS["messages"].rows_to_train(rows, "all"), llama, n=2)
    assert (every.assistant_turns, every.untrained_turns) == (3, 0)


def test_train_turns_last_is_refused_at_parse_time_on_a_source_that_is_not_chat(tmp_path):
    recipe = {"model_name_or_path": "tiny:llama", "output_dir": str(tmp_path / "out"), "use_cpu": True,
              "dataset_name": "data/samples/alpaca.jsonl", "dataset_format": "alpaca", "train_turns": "last"}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    with pytest.raises(RecipeError, match="dataset_format 'alpaca': train_turns: last picks among the assistant"):
        load_recipe(tmp_path / "r.yaml")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({**recipe, "dataset_format": "alpaca_chat"}))
    assert load_recipe(tmp_path / "r.yaml").data.train_turns == "last"
