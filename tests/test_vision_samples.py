"""Sample prompts about images (reporting/vision_samples.py): where they come from, how they are shown and saved,
and greedy generation on the tiny qwen3_5 twin with an image equal to transformers' own `generate`."""

from __future__ import annotations

import hashlib
import io
import json

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, GenerationConfig

from sft_recipes.config import load_recipe
from sft_recipes.data.vision import IMAGE_PLACEHOLDER, VisionProcessing, mrope_positions
from sft_recipes.errors import RecipeError
from sft_recipes.reporting.samples import (
    BEFORE_FILE, default_sample_prompts, generate_answers, greedy_generate, sample_prompts_for_run,
    samples_markdown, save_base_answers, write_samples,
)
from sft_recipes.reporting.vision_samples import ImagePrompt, image_prompt, prepared, prepared_prompts
from sft_recipes.tiny import build_tokenizer, tiny_config, tiny_image_processor

SHAPES = "data/samples/vision/images"
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def processing():
    config = tiny_config("qwen3_5")
    return VisionProcessing(build_tokenizer("qwen3_5"), tiny_image_processor(config), config)


@pytest.fixture(scope="module")
def model(processing):
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(processing.config, attn_implementation="sdpa").float().eval()


def square_on_blue(width=128, height=96) -> bytes:
    image = Image.new("RGB", (width, height), (0, 0, 255))
    image.paste((255, 255, 0), (20, 10, 60, 50))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


# ── Where the prompts come from ─────────────────────────────────────────────────────────────────

def test_a_recipe_prompt_with_images_puts_them_before_its_text():
    args = load_recipe("recipes/tiny/qwen27b-vision.yaml", {"sample_prompts": [
        "Plain?", {"text": "Which is larger?", "images": [f"{SHAPES}/000_0.png", f"{SHAPES}/002_0.png"]}]}).training
    plain, about_images = sample_prompts_for_run(args, [])
    assert plain == "Plain?"
    assert about_images.turn == IMAGE_PLACEHOLDER * 2 + "Which is larger?"
    assert about_images.names == (f"{SHAPES}/000_0.png", f"{SHAPES}/002_0.png")
    assert about_images.sizes == ((96, 64), (128, 64))


@pytest.mark.parametrize(("entry", "message"), [
    ({"text": "?", "images": ["nowhere.png"]},
     "sample_prompts[0]: cannot read image nowhere.png (missing_image): give the path of a PNG or JPEG file, "
     "relative to the directory the run starts in, or remove the prompt."),
    ({"text": "?", "images": [f"{SHAPES}/000_0.png", "README.md"]},
     "sample_prompts[0]: cannot read image README.md (unreadable_image): give the path"),
    ({"text": "?", "image": ["a.png"]}, "sample_prompts[0] is {'text': '?', 'image': ['a.png']}: a sample prompt is a "
     "string, or a mapping {text: \"...\", images: [path, ...]}"),
    ({"text": "<|image_pad|>?", "images": [f"{SHAPES}/000_0.png"]}, "sample_prompts[0]: its text holds vision tokens"),
])
def test_a_bad_recipe_prompt_with_images_is_refused_at_start_naming_the_fix(entry, message):
    args = load_recipe("recipes/tiny/qwen27b-vision.yaml", {"sample_prompts": [entry]}).training
    with pytest.raises(RecipeError) as error:
        sample_prompts_for_run(args, [])
    assert str(error.value).startswith(message)


def test_a_text_run_refuses_prompts_with_images():
    args = load_recipe("recipes/tiny/llama8b.yaml", {"sample_prompts": [
        {"text": "?", "images": [f"{SHAPES}/000_0.png"]}]}).training
    with pytest.raises(RecipeError, match="sample_prompts has a prompt with images, and this run trains on no images"):
        prepared_prompts(sample_prompts_for_run(args, []), None)


def test_sample_prompts_parse_from_yaml_and_the_command_line():
    entry = {"text": "Colour", "images": ["a.png"]}
    assert load_recipe("recipes/tiny/llama8b.yaml", ["--sample_prompts", "[Hi, {text: Colour, images: [a.png]}]"]
                       ).training.sample_prompts == ["Hi", entry]
    assert load_recipe("recipes/tiny/llama8b.yaml", ["--sample_prompts", "[]"]).training.sample_prompts == []
    # One prompt, or several words, as TRL's parser reads a list option
    assert load_recipe("recipes/tiny/llama8b.yaml", ["--sample_prompts", "Hi"]).training.sample_prompts == ["Hi"]
    assert load_recipe("recipes/tiny/llama8b.yaml", ["--sample_prompts", "Hi there", "What is 2+2?"]
                       ).training.sample_prompts == ["Hi there", "What is 2+2?"]
    with pytest.raises(RecipeError, match="'sample_prompts' must be a list, got 3 "):
        load_recipe("recipes/tiny/llama8b.yaml", ["--sample_prompts", "3"])
    with pytest.raises(RecipeError, match="sample_prompts"):
        load_recipe("recipes/tiny/llama8b.yaml", ["--sample_prompts", "[3]"])
    for recipe in ("recipes/tiny/qwen27b-vision.yaml", "recipes/qwen27b-vision.yaml"):  # the data's defaults
        assert load_recipe(recipe, planning=True).training.sample_prompts is None


def test_an_image_runs_default_prompts_are_its_rows_first_user_turns_with_their_images(processing):
    from sft_recipes.data.formats import Tokenization
    from sft_recipes.data.mixture import build_source_data

    recipe = load_recipe("recipes/tiny/qwen27b-vision.yaml", {"dataset_name": None, "datasets": [
        {"path": "data/samples/vision/shapes.jsonl", "dataset_format": "vision_messages"},
        {"path": "data/samples/ultrachat.jsonl", "dataset_format": "messages"}]})
    sources = build_source_data(recipe.data, Tokenization(max_length=None), processing.tokenizer, seed=0,
                                block_length=256)
    first, text, second = sample_prompts_for_run(recipe.training, sources.raw_train, sources.raw_eval)
    assert first == ImagePrompt(IMAGE_PLACEHOLDER + "What colour is the shape?", (), (f"{SHAPES}/000_0.png",),
                                ((96, 64),))
    assert text == "Convert 27 weeks to days."
    assert second.turn == IMAGE_PLACEHOLDER + "What shape is in the picture?"
    assert second.names == (f"{SHAPES}/001_0.png",)


def test_a_user_turn_takes_only_its_own_images_and_one_without_images_is_text(tmp_path):
    records = [{"bytes": square_on_blue(), "path": None}, {"bytes": None, "path": f"{SHAPES}/002_0.png"}]
    later_image = {"messages": [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hello?"},
                                {"role": "assistant", "content": "Hi."},
                                {"role": "user", "content": IMAGE_PLACEHOLDER + "And this?"}], "images": records[:1]}
    second_turn = {"messages": [{"role": "user", "content": IMAGE_PLACEHOLDER + "Same?" + IMAGE_PLACEHOLDER},
                                {"role": "assistant", "content": "No."}], "images": records}
    prompts = default_sample_prompts([], [([later_image, second_turn], "vision_messages")])
    assert prompts[0] == "Hello?"
    assert prompts[1].names == ("bytes:" + hashlib.sha1(records[0]["bytes"]).hexdigest()[:12],
                                f"{SHAPES}/002_0.png")
    assert prompts[1].sizes == ((128, 96), (128, 64))


# ── How they are shown and kept ─────────────────────────────────────────────────────────────────

def test_samples_md_shows_each_image_placeholder_with_its_name_and_size():
    prompt = ImagePrompt(IMAGE_PLACEHOLDER + "Same colour as" + IMAGE_PLACEHOLDER + "?", (),
                         ("shapes/003.png", "bytes:0a0ec816f184"), ((128, 96), (64, 64)))
    text = samples_markdown(["Hi", prompt], ["b1", "b2"], ["a1", "a2"])
    assert ("## 2. Prompt\n\n> [image 1: shapes/003.png, 128x96]\n> Same colour as\n"
            "> [image 2: bytes:0a0ec816f184, 64x64]\n> ?\n") in text
    assert "## 1. Prompt\n\n> Hi\n" in text


def test_samples_before_json_round_trips_prompts_with_images(processing, model, tmp_path):
    def prompt(path):
        return prepared(image_prompt(IMAGE_PLACEHOLDER + "Colour?", [{"bytes": None, "path": path}]), processing)

    prompts = ["Hi", prompt(f"{SHAPES}/000_0.png")]
    save_base_answers(tmp_path, prompts, ["before 1", "before 2"])
    assert json.loads((tmp_path / BEFORE_FILE).read_text())["prompts"] == [
        "Hi", {"text": IMAGE_PLACEHOLDER + "Colour?", "images": [f"{SHAPES}/000_0.png"]}]
    resumed = ["Hi", prompt(f"{SHAPES}/000_0.png")]  # a resumed run makes its prompts again
    text = write_samples(tmp_path, resumed, model, processing.tokenizer, max_new_tokens=2).read_text()
    assert "**Before training (base model)**\n\n> before 2\n" in text
    assert "> [image 1: data/samples/vision/images/000_0.png, 96x64]\n> Colour?\n" in text
    other = write_samples(tmp_path, ["Hi", prompt(f"{SHAPES}/001_0.png")], model, processing.tokenizer,
                          max_new_tokens=2).read_text()
    assert "before 2" not in other and "> (not generated)" in other


# ── Generation ──────────────────────────────────────────────────────────────────────────────────

@pytest.fixture(scope="module")
def square_prompt(processing):
    return prepared(image_prompt(IMAGE_PLACEHOLDER + "What colour is the square?",
                                 [{"bytes": square_on_blue(), "path": None}]), processing)


def reference_tokens(model, prefill) -> list[int]:
    ids = prefill["input_ids"]
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=prefill["pixel_values"],
                         image_grid_thw=prefill["image_grid_thw"], mm_token_type_ids=prefill["mm_token_type_ids"],
                         generation_config=config)
    return out[0, ids.shape[1]:].tolist()


def ours(model, prefill, **changed) -> list[int]:
    inputs = {**prefill, **changed}
    ids = inputs.pop("input_ids")[0].tolist()
    return greedy_generate(model, [ids], NEW_TOKENS, set(), 0, prefill={k: v for k, v in inputs.items()
                                                                          if v is not None})[0]


def test_greedy_with_an_image_equals_transformers_generate_and_feeds_the_models_positions(model, square_prompt):
    prefill = square_prompt.prefill
    ids = prefill["input_ids"]
    assert prefill["image_grid_thw"].tolist() == [[1, 6, 8]]  # 128x96: 12 image tokens
    mrope = mrope_positions(model.config, ids[0], prefill["image_grid_thw"])
    assert torch.equal(prefill["position_ids"], torch.cat([torch.arange(ids.shape[1])[None], mrope])[:, None])
    fed = []
    hook = model.register_forward_pre_hook(lambda _, args, kwargs: fed.append(kwargs["position_ids"].clone()),
                                           with_kwargs=True)
    try:
        tokens = ours(model, prefill)
    finally:
        hook.remove()
    assert tokens == reference_tokens(model, prefill) and len(tokens) == NEW_TOKENS
    length, top = ids.shape[1], int(mrope.max())
    assert top == length - 1 - 12 + 4  # the 12 image tokens span max(h, w) / merge = 4 positions
    assert [step[:, 0, 0].tolist() for step in fed[1:]] == [[length + s] + [top + 1 + s] * 3
                                                             for s in range(NEW_TOKENS - 1)]


def test_plain_text_positions_answer_otherwise(model, square_prompt):
    """The negative control: the same prompt and pixels with 1-D positions (no mRoPE rows) give other next-token
    logits. Logits, not greedy tokens: the tiny twin's 6 greedy tokens can coincide (they did after its sample
    data changed), which would make the control pass on a broken position path."""
    inputs = {name: value for name, value in square_prompt.prefill.items() if value is not None}
    with torch.no_grad():
        own = model(**inputs).logits[0, -1]
        plain = model(**{**inputs, "position_ids": torch.arange(inputs["input_ids"].shape[1]).unsqueeze(0)}).logits[0, -1]
    assert (own - plain).abs().max() > 1e-3


def test_text_and_image_prompts_answer_as_each_alone(model, processing, square_prompt):
    tokenizer = processing.tokenizer
    both = generate_answers(model, tokenizer, ["Hi", square_prompt, "Name a colour."], max_new_tokens=3)
    assert both == [generate_answers(model, tokenizer, [prompt], max_new_tokens=3)[0]
                    for prompt in ("Hi", square_prompt, "Name a colour.")]


def _lockstep_worker(rank: int, port: int, out_dir: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from sft_recipes.architectures.kernels import use_torch_references_where_triton_cannot_run
    from sft_recipes.architectures.qwen3_5 import prepare_for_image_packing

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    config = tiny_config("qwen3_5")
    processing = VisionProcessing(build_tokenizer("qwen3_5"), tiny_image_processor(config), config)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").float().eval()
    use_torch_references_where_triton_cannot_run()  # as sft_recipes.loading does for every model it loads
    prepare_for_image_packing(model)  # as in an image run: the tower runs (on a blank image) every forward
    for block in [*model.model.visual.blocks, *model.model.language_model.layers]:
        fully_shard(block)
    fully_shard(model)
    forward_calls = []
    model.register_forward_hook(lambda *_: forward_calls.append(1))
    prompt = prepared(image_prompt(IMAGE_PLACEHOLDER + "What colour is the square?",
                                   [{"bytes": square_on_blue(), "path": None}]), processing)
    answers = generate_answers(model, processing.tokenizer, [prompt], max_new_tokens=3, in_lockstep=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"answers": answers, "forward_calls": len(forward_calls)}, f)
    dist.destroy_process_group()


@pytest.mark.fsdp  # text prompts in lockstep: tests/test_samples_chat.py
def test_image_prompts_answer_in_lockstep_under_fsdp2_as_in_one_process(model, processing, square_prompt, tmp_path):
    from conftest import free_port
    from worker_processes import spawn

    spawn(_lockstep_worker, (free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert ranks[0] == ranks[1]  # same answers, same number of forward calls: no rank waits alone
    assert ranks[0]["answers"] == generate_answers(model, processing.tokenizer, [square_prompt], max_new_tokens=3)
    assert ranks[0]["forward_calls"] == 3  # the prefill with its image, then one per new token
