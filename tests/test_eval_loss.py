"""Eval loss is the mean over every supervised eval token: packed or padded, on 1 or 2 processes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import REPO_ROOT, launch_sft, read_summary
from sft_recipes.config import TrainingArguments, load_recipe
from sft_recipes.data.blocks import RankLocalBlockStream, collate_blocks
from sft_recipes.data.masking import tokenize_conversations
from sft_recipes.architectures import prepare_for_packing
from sft_recipes.data.collator import BlockDiagonalCollator
from sft_recipes.data.mixture import describe_eval, eval_blocks, refuse_eval_without_answers, token_counts
from sft_recipes.errors import RecipeError
from sft_recipes.loading import load_tokenizer
from sft_recipes.run import Run
from sft_recipes.run.data import source_data
from sft_recipes.tiny import ensure_tiny, tiny_config
from sft_recipes.trainer import RecipeSFTTrainer
from test_packing_equivalence import tiny_model

EXAMPLE = REPO_ROOT / "recipes" / "examples" / "tiny_llama_mixture.yaml"
MAX_LENGTH = 256
TOLERANCE = 1e-5


def tokenizer_of(model_type: str):
    return load_tokenizer(SimpleNamespace(model_revision=None), ensure_tiny(model_type))  # pad token as sft.py sets it


def conversations(count: int) -> list[dict]:
    lines = (REPO_ROOT / "data" / "samples" / "ultrachat.jsonl").read_text().splitlines()[:count]
    return [{"messages": json.loads(line)["messages"]} for line in lines]


def loss_sum_alone(model, input_ids: list[int], labels: list[int]) -> tuple[float, int]:
    """(summed loss, target count) of one example run on its own, no padding, no packing."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([input_ids]), use_cache=False).logits[0]
    targets = torch.tensor(labels[1:])
    return F.cross_entropy(logits[:-1].double(), targets, ignore_index=-100, reduction="sum").item(), int(
        (targets != -100).sum())


def trainer_for(model, tokenizer, eval_dataset, collator, tmp_path, **train):
    """A trainer to evaluate with; `train`: its train_dataset or block_stream (the trainer needs one)."""
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=2, max_length=MAX_LENGTH,
                             use_cpu=True, bf16=False, report_to=[], activation_checkpointing=False)
    return RecipeSFTTrainer(model=model, args=args, eval_dataset=eval_dataset, data_collator=collator,
                            processing_class=tokenizer, **train)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5"])
def test_packed_eval_loss_equals_the_token_mean_of_the_examples_run_alone(model_type, tmp_path):
    tokenizer = tokenizer_of(model_type)
    model = tiny_model(model_type, "sdpa")  # qwen3_5: slowly decaying gates, so a leak across examples would show
    prepare_for_packing(model)
    rows = Dataset.from_list(conversations(6))  # llama: 5 blocks, qwen3_5: 3, each with a 2-conversation block
    blocks, left_out = eval_blocks(rows, tokenizer, MAX_LENGTH)
    assert left_out == {}  # every conversation has an answer in its first MAX_LENGTH tokens
    assert len(blocks) > 2 and max(len(lengths) for lengths in blocks["seq_lengths"]) >= 2  # packed, several batches

    collator = collate_blocks(BlockDiagonalCollator(MAX_LENGTH, tokenizer.pad_token_id, block_per_row=True))
    stream = RankLocalBlockStream(rows, tokenizer, MAX_LENGTH, rank=0, world_size=1)
    metrics = trainer_for(model, tokenizer, blocks, collator, tmp_path, block_stream=stream).evaluate()

    columns = tokenize_conversations(tokenizer, rows["messages"], None)
    sums, counts = zip(*(loss_sum_alone(model, ids[:MAX_LENGTH],
                                        [t if keep else -100 for t, keep in zip(ids, mask)][:MAX_LENGTH])
                         for ids, mask in zip(columns["input_ids"], columns["assistant_masks"])))
    assert metrics["eval_tokens"] == sum(counts)
    assert abs(metrics["eval_loss"] - sum(sums) / sum(counts)) < TOLERANCE


def test_padded_eval_loss_weighs_every_token_not_every_batch(tmp_path):
    tokenizer = tokenizer_of("llama")
    model = AutoModelForCausalLM.from_pretrained(ensure_tiny("llama")).float()
    torch.manual_seed(0)
    # Three rows with 40, 2 and 9 targets: batches of 2 are [40 + 2] and [9].
    rows = []
    for length, targets in ((48, 40), (30, 2), (20, 9)):
        ids = torch.randint(10, 500, (length,)).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * (length - targets) + ids[length - targets:]})
    metrics = trainer_for(model, tokenizer, Dataset.from_list(rows), None, tmp_path,
                          train_dataset=Dataset.from_list(rows)).evaluate()

    sums, counts = zip(*(loss_sum_alone(model, row["input_ids"], row["labels"]) for row in rows))
    token_mean = sum(sums) / sum(counts)
    mean_of_batch_means = ((sums[0] + sums[1]) / (counts[0] + counts[1]) * 2 + sums[2] / counts[2]) / 3
    assert metrics["eval_tokens"] == 51
    assert abs(metrics["eval_loss"] - token_mean) < TOLERANCE
    assert abs(mean_of_batch_means - token_mean) > 1e-3  # what transformers' evaluation_loop would report


@pytest.mark.fsdp
def test_two_process_mixture_run_reports_the_global_token_mean_eval_loss(tmp_path):
    out = tmp_path / "run"
    launch_sft(EXAMPLE, "--max_steps", "2", "--eval_steps", "2", "--report_to", "none",
               "--output_dir", str(out))
    summary = read_summary(out)
    assert set(summary["eval_losses"]) == {"2"}  # at eval_steps; the end is step 2, not evaluated twice

    recipe = load_recipe(EXAMPLE)
    tokenizer = AutoTokenizer.from_pretrained(out)
    eval_rows = source_data(Run(recipe=recipe, source=None, batch_derivation=""), tokenizer).eval
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)  # the exported step-2 weights
    sums, counts = zip(*(loss_sum_alone(model, row["input_ids"], row["labels"]) for row in eval_rows))
    assert abs(summary["eval_loss"] - sum(sums) / sum(counts)) < TOLERANCE
    report = json.loads((out / "data_report.json").read_text())
    assert [source["mixture_rows"] for source in report["sources"]] == [283, 121]


def test_eval_scores_in_tiles_and_never_builds_the_full_logits(tmp_path):
    """TRL's fused head, as in training: one 1024-token row over a 262,144-token vocabulary needs 1 GiB of
    fp32 logits. Measured here above the weights: the model's own loss (eval before) peaks at 2.00x that, the
    fused head at 0.53x (a 1024 x 32,768 tile and the CPU fallback's fp32 temporaries)."""
    from test_plan import LiveTensorBytes

    vocab, length = 262_144, 1024
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=vocab), dtype=torch.float32)
    ids = torch.randint(0, vocab, (length,)).tolist()
    rows = Dataset.from_list([{"input_ids": ids, "labels": ids}])
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=1, max_length=None, use_cpu=True,
                             bf16=False, report_to=[], activation_checkpointing=False)
    trainer = RecipeSFTTrainer(model=model, args=args, train_dataset=rows, eval_dataset=rows,
                               processing_class=tokenizer_of("llama"))
    tracker = LiveTensorBytes()
    for tensor in [*model.parameters(), *model.buffers()]:
        tracker.track(tensor)
    weights = tracker.live
    with tracker:
        metrics = trainer.evaluate()
    full_logits = length * vocab * 4
    assert metrics["eval_tokens"] == length - 1 and metrics["eval_loss"] > 0
    assert tracker.peak - weights < 0.75 * full_logits, (tracker.peak - weights) / full_logits


def test_a_packed_eval_conversation_with_no_answer_in_its_first_block_is_left_out_and_an_eval_set_of_them_refused():
    # The tiny tools recipe held out 3 tool conversations whose answers start past token 1,024 (the schemas come
    # first): eval loss was 0 / 0 = nan at every eval, and the run went on.
    tokenizer = tokenizer_of("llama")
    short = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    long = {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "Done."}]}
    (short_ids,) = tokenize_conversations(tokenizer, [short["messages"]], None)["input_ids"]
    assert len(short_ids) < 128 < len(tokenize_conversations(tokenizer, [long["messages"]], None)["input_ids"][0])

    unanswered = {"messages": [{"role": "user", "content": "Hi"}]}  # the masker drops it: no_assistant_turn
    blocks, left_out = eval_blocks(Dataset.from_list([long, short, unanswered]), tokenizer, 128)
    assert left_out == {"answer_past_max_length": 1, "no_assistant_turn": 1}
    assert blocks["seq_lengths"] == [[len(short_ids)]]
    answer = [t for t in blocks[0]["labels"] if t != -100]
    assert tokenizer.decode(answer) == "Hello.<|eot_id|>"
    counts = token_counts(blocks)
    assert counts == (len(short_ids), len(answer))
    refuse_eval_without_answers(blocks, counts[1], left_out, 128)  # something to score: no refusal
    assert describe_eval(blocks, counts, left_out, 128) == (
        f"[data] eval: 1 conversations packed whole into 1 blocks (2 left out: 1 without an answer in their first 128 "
        f"tokens, no_assistant_turn 1), {len(short_ids)} tokens, {len(answer)} supervised")

    nothing, left_out = eval_blocks(Dataset.from_list([long]), tokenizer, 128)
    assert (len(nothing), left_out) == (0, {"answer_past_max_length": 1})
    assert describe_eval(nothing, token_counts(nothing), left_out, 128) == (
        "[data] eval: 0 conversations packed whole into 0 blocks (1 left out: 1 without an answer in their first 128 "
        "tokens), 0 tokens, 0 supervised")
    with pytest.raises(RecipeError, match=r"^The eval set has nothing to score: none of its 1 conversations has an "
                                          r"answer to score \(1 without an answer in their first 128 tokens; "
                                          r"max_length: .*Raise max_length"):
        refuse_eval_without_answers(nothing, 0, left_out, 128)
    # Unpacked eval rows all dropped as they were tokenized (their own report): the same refusal, without a count
    with pytest.raises(RecipeError, match=r"^The eval set has nothing to score: no eval row keeps a supervised token "
                                          r"within max_length=1024\. Raise max_length"):
        refuse_eval_without_answers(Dataset.from_list([]), 0, {}, 1024)
