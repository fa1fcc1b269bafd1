"""Image + text SFT (dataset_format: vision_messages): rows, literal tokens, and the packing gate.

The gate: on the tiny qwen3_5 twin with its vision tower, image + text examples packed in one block
compute exactly what each computes alone through the model's own path (which derives its mRoPE
positions itself from ``mm_token_type_ids``), logits, loss and gradients -- the tower's and merger's
too when they train; negative controls (positions not per example, images shifted by one example)
show the comparison catches those leaks, and the preflight refuses a packing that leaks.
"""

import io
import os
import struct
import zlib

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import AutoModelForImageTextToText

from sft_recipes.architectures import prepare_for_packing
from sft_recipes.architectures import preflight
from sft_recipes.architectures.qwen3_5 import prepare_for_image_packing
from sft_recipes.data import vision
from sft_recipes.data.blocks import join_examples
from sft_recipes.data.report import DataReport
from sft_recipes.data.vision import (
    IMAGE_PLACEHOLDER,
    VisionBlockCollator,
    VisionProcessing,
    check_images,
    flatten_parts,
    open_image,
    vision_row_problem,
)
from sft_recipes.errors import RecipeError
from sft_recipes.tiny import build_tokenizer, real_config_dict, special_token_id, tiny_config, tiny_image_processor

TOLERANCE = 1e-5
CLEAR_LEAK = 1e-2
IMAGE_PAD = special_token_id("qwen3_5", "<|image_pad|>")
VISION_START = special_token_id("qwen3_5", "<|vision_start|>")
VISION_END = special_token_id("qwen3_5", "<|vision_end|>")
IM_START, IM_END = special_token_id("qwen3_5", "<|im_start|>"), special_token_id("qwen3_5", "<|im_end|>")


@pytest.fixture(scope="module")
def config():
    return tiny_config("qwen3_5")


@pytest.fixture(scope="module")
def processing(config):
    return VisionProcessing(build_tokenizer("qwen3_5"), tiny_image_processor(config), config)


def red(width=64, height=96):
    return Image.new("RGB", (width, height), (255, 0, 0))


def png_bytes(image):
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


# ── Rows ─────────────────────────────────────────────────────────────────────────────────────────

def test_parts_flatten_to_the_placeholder_qwen_templates_write():
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Red."}]}]
    flat, images = flatten_parts(messages)
    assert images == 1
    assert flat == [{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>What colour?"},
                    {"role": "assistant", "content": "Red."}]


@pytest.mark.parametrize(("row", "reason"), [
    ({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]},
                   {"role": "assistant", "content": "Two."}], "images": ["a.png"]}, "image_count_mismatch"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "draw"}]},
                   {"role": "assistant", "content": [{"type": "image"}]}], "images": ["a.png"]}, "misplaced_image"),
    ({"messages": [{"role": "user", "content": "<|image_pad|> typed in"},
                   {"role": "assistant", "content": "ok"}], "images": []}, "misplaced_image"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}], "images": ["a.png"]}, "no_assistant_turn"),
])
def test_row_rules(row, reason):
    assert vision_row_problem(row) == reason


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header says width x height (1-bit grey) and whose pixel data is a token: opened, never decoded."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def test_an_image_over_the_pixel_limit_is_image_size_not_unreadable(tmp_path):
    """20000 x 10000 = 200M pixels: PIL itself refuses to open it (DecompressionBombError), as docs/vision.md says."""
    (tmp_path / "huge.png").write_bytes(png_header_only(20_000, 10_000))
    (tmp_path / "wide.png").write_bytes(png_header_only(13_000, 13_000))  # 169M: under the limit, opens
    assert open_image({"bytes": None, "path": str(tmp_path / "huge.png")}, decode=False) == "image_size"
    assert open_image({"bytes": None, "path": str(tmp_path / "wide.png")}, decode=False) != "image_size"


def test_image_files_are_checked_and_counted(tmp_path):
    red().save(tmp_path / "red.png")
    (tmp_path / "corrupt.png").write_bytes(png_bytes(red())[:60])  # a PNG cut short
    Image.new("RGB", (4000, 10), (0, 0, 0)).save(tmp_path / "strip.png")  # aspect ratio 400
    question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]},
                {"role": "assistant", "content": "Red."}]
    rows = [{"messages": question, "images": ["red.png"]},  # relative to the data file's folder
            {"messages": question, "images": ["missing.png"]},
            {"messages": question, "images": ["corrupt.png"]},
            {"messages": question, "images": ["strip.png"]},
            {"messages": question, "images": [{"bytes": png_bytes(red(32, 32)), "path": None}]},  # datasets Image
            {"messages": question, "images": [b"not an image"]}]
    report = DataReport(source="images.jsonl", rows=len(rows))
    kept, indices = check_images(rows, tmp_path, report)
    assert indices == [0, 4]
    assert dict(report.dropped) == {"missing_image": 1, "unreadable_image": 2, "image_size": 1}
    assert kept[0]["images"] == [{"bytes": None, "path": str(tmp_path / "red.png")}]
    assert kept[0]["messages"][0]["content"] == IMAGE_PLACEHOLDER + "Colour?"


# ── Tokens ───────────────────────────────────────────────────────────────────────────────────────

def test_placeholder_expands_to_the_image_tokens_and_only_the_reply_is_supervised(processing):
    tokenizer = processing.tokenizer
    conversation = [{"role": "user", "content": IMAGE_PLACEHOLDER + "Colour?"},
                    {"role": "assistant", "content": "Red."}]
    (example,) = processing.examples([conversation], [[red(64, 96)]])
    # 64x96 pixels = 4x6 patches of 16, merged 2x2: 6 image tokens.
    assert example.image_grid_thw.tolist() == [[1, 6, 4]]
    assert example.pixel_values.shape == (24, 3 * 2 * 16 * 16)

    def text(piece):
        return tokenizer(piece, add_special_tokens=False)["input_ids"]

    reply = text("<think>\n\n</think>\n\nRed.")
    expected = ([IM_START, *text("user\n"), VISION_START, *[IMAGE_PAD] * 6, VISION_END, *text("Colour?"), IM_END,
                 *text("\n"), IM_START, *text("assistant\n")] + reply + [IM_END, *text("\n")])
    assert example.input_ids == expected
    supervised = [token for token, label in zip(example.input_ids, example.labels) if label != -100]
    assert supervised == reply + [IM_END, *text("\n")]  # Qwen3's empty think block on the last turn, as for text
    assert all(label == -100 for token, label in zip(example.input_ids, example.labels) if token == IMAGE_PAD)
    # The model's own positions: the 6 image tokens take t=4, h=4..6, w=4..5; text resumes at 4 + max(h, w) = 7.
    image = [index for index, token in enumerate(example.input_ids) if token == IMAGE_PAD]
    assert example.mrope_positions[:, image].tolist() == [[4] * 6, [4, 4, 5, 5, 6, 6], [4, 5, 4, 5, 4, 5]]
    assert example.mrope_positions[:, image[-1] + 1].tolist() == [7, 7, 7]


def test_max_pixels_bounds_the_image_tokens(config):
    processing = VisionProcessing(build_tokenizer("qwen3_5"), tiny_image_processor(config), config,
                                  max_pixels=64 * 64)
    conversation = [{"role": "user", "content": IMAGE_PLACEHOLDER + "?"}, {"role": "assistant", "content": "Red."}]
    (example,) = processing.examples([conversation], [[red(256, 256)]])
    assert example.image_grid_thw.tolist() == [[1, 4, 4]]
    assert example.input_ids.count(IMAGE_PAD) == 4


def test_a_row_whose_placeholders_and_images_disagree_is_dropped(processing):
    conversation = [{"role": "user", "content": IMAGE_PLACEHOLDER + IMAGE_PLACEHOLDER + "?"},
                    {"role": "assistant", "content": "Two."}]
    assert processing.examples([conversation], [[red()]]) == ["image_count_mismatch"]


# ── The gate ─────────────────────────────────────────────────────────────────────────────────────

def tiny_vlm(config, train_tower: bool):
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").float()
    preflight.PACKING_QUIRKS["qwen3_5"].expose_leaks(model)
    prepare_for_packing(model)
    prepare_for_image_packing(model)
    model.model.visual.requires_grad_(train_tower)
    return model.eval()


def packed_batch(examples, pad=5):
    block = join_examples([vars(example) for example in examples])
    return VisionBlockCollator(len(block["input_ids"]) + pad, pad_token_id=0)([block])


def alone(model, examples):
    """Logits and the token-weighted mean loss of each example run alone through the model's own path."""
    logits, loss_sum, targets = [], 0.0, 0
    for example in examples:
        inputs = preflight.example_inputs(example, model.config, "cpu")
        labels = inputs.pop("labels")
        out = model(**inputs, use_cache=False).logits[0]
        logits.append(out)
        loss_sum = loss_sum + F.cross_entropy(out[:-1], labels[0, 1:], ignore_index=-100, reduction="sum")
        targets += int((labels[0, 1:] != -100).sum())
    return torch.cat(logits), loss_sum / targets


@pytest.fixture(scope="module")
def examples(config):
    return preflight.probe_image_examples(config)


@pytest.mark.parametrize("train_tower", [False, True], ids=["frozen tower", "trained tower"])
def test_packed_image_blocks_equal_examples_alone_logits_loss_and_gradients(config, examples, train_tower):
    model = tiny_vlm(config, train_tower)
    batch = packed_batch(examples)
    assert batch["position_ids"].shape == (4, 1, batch["input_ids"].shape[1])
    packed = model(**batch, use_cache=False)
    packed.loss.backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    logits, loss = alone(model, examples)
    loss.backward()
    alone_grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    real = logits.shape[0]
    assert (packed.logits[0, :real] - logits).abs().max().item() < TOLERANCE
    assert (packed.loss - loss).abs().item() < TOLERANCE
    assert packed_grads.keys() == alone_grads.keys()
    tower = [name for name in packed_grads if ".visual." in name]
    assert bool(tower) == train_tower and (not train_tower or any(".merger." in name for name in tower))
    assert max((packed_grads[name] - alone_grads[name]).abs().max().item() for name in packed_grads) < TOLERANCE


def test_negative_control_positions_not_per_example_differ(config, examples):
    model = tiny_vlm(config, train_tower=False)
    batch = packed_batch(examples)
    # One running t/h/w count over the whole block, as if the block were one example.
    batch["position_ids"][1:] = torch.arange(batch["input_ids"].shape[1]).expand(3, 1, -1)
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits[0]
        logits, _ = alone(model, examples)
    assert (packed[: logits.shape[0]] - logits).abs().max().item() > CLEAR_LEAK


def test_negative_control_images_shifted_by_one_example_differ(config, examples):
    model = tiny_vlm(config, train_tower=False)
    first, text_only, third = examples
    batch = packed_batch(examples)
    # The third example's images first: the same 11 image tokens in all, each filled from the wrong example.
    batch["pixel_values"] = torch.cat([third.pixel_values, first.pixel_values])
    batch["image_grid_thw"] = torch.cat([third.image_grid_thw, first.image_grid_thw])
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits[0]
        logits, _ = alone(model, examples)
    assert (packed[: logits.shape[0]] - logits).abs().max().item() > CLEAR_LEAK


def test_a_batch_without_images_still_runs_the_tower(config, processing):
    model = tiny_vlm(config, train_tower=True)
    calls = []
    model.model.visual.register_forward_hook(lambda *args: calls.append(1))
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    (example,) = processing.examples([conversation], [[]])
    batch = packed_batch([example])
    assert batch["pixel_values"].shape[0] == 0
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    assert calls == [1]
    grads = [p.grad for p in model.model.visual.parameters()]
    assert all(grad is not None and not grad.any() for grad in grads)  # every rank reduces a (zero) gradient


def test_preflight_passes_the_real_qwen3_5_config_and_refuses_a_leaking_packing(monkeypatch):
    from transformers import AutoConfig

    real = real_config_dict("qwen3_5")
    real.pop("quantization_config", None)
    config = AutoConfig.for_model(**real)
    preflight.check_image_packing_leak(config)

    def running_positions(text_positions, mrope):  # positions not per example
        total = text_positions.shape[-1]
        return torch.cat([text_positions[None], torch.arange(total).expand(3, *text_positions.shape)])

    monkeypatch.setattr(vision, "packed_position_ids", running_positions)
    with pytest.raises(RecipeError, match="Packed image \\+ text examples leak"):
        preflight.check_image_packing_leak(config)


def test_dry_run_plans_the_vision_tower_and_the_image_tokens():
    from sft_recipes.planner.dry_run import plan_dry_run
    from sft_recipes.tiny import REALWORLD_DIR

    config = str(REALWORLD_DIR / "model_configs" / "Qwen__Qwen3.5-27B.derived.json")
    common = ["--model_name_or_path", config]
    environment = dict(os.environ)
    frozen = plan_dry_run("recipes/qwen27b-vision.yaml", common, "accelerate_configs/fsdp2_8gpu.yaml")
    assert "vision tower      453,650,672 parameters (tower frozen, merger trains: 37,759,232 trainable" in frozen
    # 602,112 pixels / (16 * 2)**2 per token = 588 tokens; 8192 // 588 = 13 images per block.
    assert "at most 588 image tokens per image" in frozen and "holds up to 13 such images" in frozen
    trained = plan_dry_run("recipes/qwen27b-vision.yaml", [*common, "--freeze_vision_tower", "false"],
                           "accelerate_configs/fsdp2_8gpu.yaml")
    added = [float(line.split("+")[1].split()[0]) for text in (frozen, trained) for line in text.splitlines()
             if "vision memory" in line]
    assert added[1] > 100 * added[0] > 0  # a trained tower keeps its activations
    assert dict(os.environ) == environment  # the config's FSDP_* are the plan's, not this process's from now on


def test_sequence_parallelism_on_image_data_is_refused_at_parse_time():
    from sft_recipes.lint import LintContext, lint_recipe
    from sft_recipes.config import load_recipe

    recipe = load_recipe("recipes/tiny/qwen27b-vision.yaml", ["--sequence_parallel_size", "2"])
    with pytest.raises(RecipeError, match="sequence parallelism does not shard image blocks yet"):
        lint_recipe(recipe, LintContext(world_size=2, has_accelerator=False))


def test_image_sources_need_the_image_block_stream():
    from sft_recipes.config import load_recipe

    with pytest.raises(RecipeError, match="image rows train through the image block stream: set pack_blocks: true"):
        load_recipe("recipes/tiny/qwen27b-vision.yaml", ["--pack_blocks", "false"])


def test_image_and_text_only_sources_mix_in_one_block_stream(processing):
    from sft_recipes.config import load_recipe
    from sft_recipes.data.blocks import collate_blocks
    from sft_recipes.data.mixture import build_source_data
    from sft_recipes.data.formats import Tokenization

    recipe = load_recipe("recipes/tiny/qwen27b-vision.yaml", {"dataset_name": None, "datasets": [
        {"path": "data/samples/vision/shapes.jsonl", "dataset_format": "vision_messages"},
        {"path": "data/samples/ultrachat.jsonl", "dataset_format": "messages"}]})
    sources = build_source_data(recipe.data, Tokenization(max_length=None), processing.tokenizer, seed=0,
                                block_length=256)
    assert [entry.checked.kept for entry in sources.report.sources] == [60, 200]
    stream = vision.VisionBlockStream(sources.train, processing, 256, rank=0, world_size=1, packing_window=8,
                                      num_sources=2)
    collate = collate_blocks(VisionBlockCollator(256, processing.tokenizer.pad_token_id))
    blocks = []
    for block in stream:
        if block["stream_exhausted"]:
            break
        blocks.append(block)
    with_images = [block for block in blocks if int(block["num_images"].sum())]
    assert with_images and len(with_images) < len(blocks)  # text-only examples packed too
    batch = collate(blocks[:2])
    tokens = (batch["input_ids"] == IMAGE_PAD).sum().item()
    assert tokens == sum(int(block["image_grid_thw"].prod(-1).sum()) // 4 for block in blocks[:2])
    assert batch["stream_stats"].sources.keys() <= {0, 1} and batch["position_ids"].shape[:2] == (4, 2)


def test_the_tiny_twin_ships_its_image_processor():
    from transformers import AutoImageProcessor

    from sft_recipes.tiny import ensure_tiny

    processor = AutoImageProcessor.from_pretrained(ensure_tiny("qwen3_5"))
    assert (processor.patch_size, processor.merge_size, processor.temporal_patch_size) == (16, 2, 2)


def test_the_mask_audit_shows_image_placeholders_outside_the_supervised_spans(processing):
    from sft_recipes.config import load_recipe
    from sft_recipes.data.audit import audit_dataset, format_report
    from sft_recipes.data.sources import load_checked_dataset

    recipe = load_recipe("recipes/tiny/qwen27b-vision.yaml")
    rows, report = load_checked_dataset(recipe.data)
    assert report.kept == 60
    text = format_report(audit_dataset(rows, processing.tokenizer, 1))
    assert "user\n<|vision_start|><|image_pad|><|vision_end|>What colour is the shape?<|im_end|>" in text
    assert "[[<think>\n\n</think>\n\nIt is blue.<|im_end|>\n]]" in text


def test_eval_blocks_pack_whole_examples_and_make_their_pixels_when_read(processing, monkeypatch):
    """Held-out image rows: packed once like the training blocks; a block read twice is the same tensors, equal to
    its rows' examples joined; a conversation longer than a block is left out, never cut; select keeps blocks."""
    from sft_recipes.data.formats import Tokenization
    from sft_recipes.data.mixture import build_source_data, describe_eval, refuse_eval_without_answers
    from sft_recipes.data import vision_eval
    from sft_recipes.data.vision_eval import VisionEvalBlocks
    from sft_recipes.config import load_recipe

    recipe = load_recipe("recipes/tiny/qwen27b-vision.yaml", ["--test_split_size", "0.1"])
    sources = build_source_data(recipe.data, Tokenization(max_length=None), processing.tokenizer, seed=0,
                                block_length=128)
    rows = sources.eval
    held_out = sources.report.sources[0].eval_rows
    assert len(rows) == held_out > 2 and rows.column_names == ["messages", "images"]
    monkeypatch.setattr(vision_eval, "PLAN_ROWS", 4)  # the plan made over several chunks of rows
    blocks = VisionEvalBlocks(rows, processing, 128)
    alone = processing.examples([row["messages"] for row in rows], [row["images"] for row in rows])
    assert sorted(index for plan in blocks.plan for index in plan) == list(range(held_out)) and blocks.left_out == {}
    assert len(blocks) < held_out  # packed, not one example per block
    for index, plan in enumerate(blocks.plan):
        block, again = blocks[index], blocks[index]
        expected = join_examples([{"input_ids": alone[row].input_ids, "labels": alone[row].labels,
                                   "pixel_values": alone[row].pixel_values, "image_grid_thw": alone[row].image_grid_thw,
                                   "mrope_positions": alone[row].mrope_positions} for row in plan])
        assert block["input_ids"] == expected["input_ids"] and block["labels"] == expected["labels"]
        assert block["seq_lengths"] == [len(alone[row].input_ids) for row in plan] and sum(block["seq_lengths"]) <= 128
        for key in ("pixel_values", "image_grid_thw", "mrope_positions"):
            assert torch.equal(block[key], expected[key]) and torch.equal(again[key], block[key]), key
        assert block["num_images"].tolist() == [len(alone[row].image_grid_thw) for row in plan]
    assert blocks.select([len(blocks) - 1]).plan == [blocks.plan[-1]]
    assert blocks.tokens == sum(len(alone[row].input_ids) for row in range(held_out))
    assert describe_eval(blocks, (blocks.tokens, blocks.supervised), blocks.left_out, 128) == (
        f"[data] eval: {held_out} conversations packed whole into {len(blocks)} blocks, {blocks.tokens:,} tokens, "
        f"{blocks.supervised:,} supervised")
    longest = max(len(example.input_ids) for example in alone)
    short = VisionEvalBlocks(rows, processing, longest - 1)  # the longest no longer fits a block: left out
    too_long = sum(len(example.input_ids) == longest for example in alone)
    assert short.left_out == {"longer_than_max_length": too_long} and too_long >= 1
    assert f"blocks ({too_long} left out: {too_long} longer than a block of {longest - 1} tokens (images are never " \
           "cut)), " in describe_eval(short, (short.tokens, short.supervised), short.left_out, longest - 1)
    # A conversation the masker drops is counted under its reason, as a text run's eval line counts it.
    unanswered = rows.map(lambda row: {"messages": [turn for turn in row["messages"] if turn["role"] != "assistant"]})
    none_left = VisionEvalBlocks(unanswered, processing, 128)
    assert (len(none_left), none_left.left_out) == (0, {"no_assistant_turn": held_out})
    with pytest.raises(RecipeError, match=f"The eval set has nothing to score: none of its {held_out} conversations "
                                          f"has an answer to score \\(no_assistant_turn {held_out}; max_length"):
        refuse_eval_without_answers(none_left, none_left.supervised, none_left.left_out, 128)


def test_image_eval_rows_in_a_text_run_are_refused_at_parse_time():
    from sft_recipes.config import load_recipe

    with pytest.raises(RecipeError, match="shapes.jsonl has dataset_format vision_messages: the run trains on no "
                                          "images, so its eval has no image processing"):
        load_recipe("recipes/tiny/qwen27b.yaml", ["--dataset_streaming", "false", "--eval_datasets",
                                                  "[{path: data/samples/vision/shapes.jsonl, dataset_format: vision_messages}]"])
