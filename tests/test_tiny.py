"""Tiny stand-ins: configs keep the real architecture, tokenizers carry the real templates,
checkpoints load offline with the right auto class and build deterministically."""

from __future__ import annotations

import datetime
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from sft_recipes import tiny

REALWORLD = Path(tiny.REALWORLD_DIR)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
]


@pytest.fixture(scope="module")
def tokenizers_by_family():
    return {family: tiny.build_tokenizer(family) for family in tiny.MODEL_TYPES}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {model_type: tiny.ensure_tiny(model_type, root=root) for model_type in tiny.MODEL_TYPES}


# --- configs -------------------------------------------------------------------------------


def test_llama_config_keeps_real_architecture():
    config = tiny.tiny_config("llama")
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.rope_parameters == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    }
    assert config.max_position_embeddings == 131072
    assert config.tie_word_embeddings is False
    assert (config.attention_bias, config.mlp_bias) == (False, False)
    # GQA group of the real model: 32 query heads per 8 kv heads.
    assert config.num_attention_heads // config.num_key_value_heads == 4
    assert config.num_attention_heads * config.head_dim == config.hidden_size
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (64, 128, 512)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, 1, None)


def test_gpt_oss_config_keeps_moe_yarn_and_sliding_pattern():
    config = tiny.tiny_config("gpt_oss")
    assert config.architectures == ["GptOssForCausalLM"]
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert (config.num_local_experts, config.num_experts_per_tok) == (4, 2)
    assert config.rope_parameters["rope_type"] == "yarn"
    assert config.rope_parameters["factor"] == 32.0
    assert config.rope_parameters["original_max_position_embeddings"] == 4096
    assert config.attention_bias is True
    assert config.num_attention_heads // config.num_key_value_heads == 8
    # As in the real model, the attention width differs from the residual width.
    assert config.num_attention_heads * config.head_dim != config.hidden_size
    assert config.sliding_window == 16
    assert config.swiglu_limit == 7.0
    assert not hasattr(config, "quantization_config")
    assert (config.eos_token_id, config.pad_token_id) == (2, 1)


def test_qwen3_5_config_is_the_vlm_with_hybrid_text_tower():
    config = tiny.tiny_config("qwen3_5")
    text = config.text_config
    assert config.architectures == ["Qwen3_5ForConditionalGeneration"]
    assert config.model_type == "qwen3_5"
    assert text.layer_types == ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    assert text.linear_conv_kernel_dim == 4
    assert text.linear_num_value_heads // text.linear_num_key_heads == 3
    assert text.num_attention_heads // text.num_key_value_heads == 6
    assert text.rope_parameters["partial_rotary_factor"] == 0.25
    # 32 * 0.25 / 2 = 4 rotary frequencies, split over (t, h, w).
    assert text.rope_parameters["mrope_section"] == [2, 1, 1]
    assert config.vision_config.out_hidden_size == text.hidden_size == 64
    assert (config.vision_start_token_id, config.vision_end_token_id) == (3, 4)
    assert (config.image_token_id, config.video_token_id) == (5, 6)
    assert config.tie_word_embeddings is False and text.tie_word_embeddings is False


@pytest.mark.parametrize("model_type", tiny.MODEL_TYPES)
def test_config_is_cache_free_and_dropout_free(model_type):
    text = tiny.tiny_config(model_type).get_text_config()
    assert text.use_cache is False
    assert text.attention_dropout == 0.0


def test_more_layers_recut_the_real_layer_pattern():
    config = tiny.tiny_config("qwen3_5", num_hidden_layers=8)
    hybrid_block = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    assert config.text_config.layer_types == hybrid_block * 2
    assert tiny.tiny_config("gpt_oss", num_hidden_layers=4).layer_types == ["sliding_attention", "full_attention"] * 2


def test_overrides_and_vocab_size_apply():
    config = tiny.tiny_config("llama", vocab_size=1024, num_hidden_layers=3)
    assert (config.vocab_size, config.num_hidden_layers) == (1024, 3)
    assert tiny.tiny_config("qwen3_5", vocab_size=1024).text_config.vocab_size == 1024


def test_misspelled_override_is_rejected():
    with pytest.raises(ValueError, match="hiden_size"):
        tiny.tiny_config("llama", hiden_size=32)


def test_unknown_model_type_is_rejected():
    with pytest.raises(ValueError, match="llama, qwen3_5, gpt_oss"):
        tiny.tiny_config("mistral")


# --- tokenizers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family, text, expected_ids",
    [
        ("llama", "<|begin_of_text|><|start_header_id|><|end_header_id|><|eot_id|><|end_of_text|>", [0, 3, 4, 6, 1]),
        ("qwen3_5", "<|im_start|><|im_end|><|endoftext|><|image_pad|>", [1, 2, 0, 5]),
        ("gpt_oss", "<|start|><|channel|><|message|><|end|><|return|><|call|><|endoftext|>", [5, 4, 7, 6, 2, 8, 1]),
    ],
)
def test_special_tokens_are_single_ids(tokenizers_by_family, family, text, expected_ids):
    assert tokenizers_by_family[family](text, add_special_tokens=False).input_ids == expected_ids


def test_qwen_think_tags_are_single_ids_but_not_special(tokenizers_by_family):
    tokenizer = tokenizers_by_family["qwen3_5"]
    ids = tokenizer("<think></think>", add_special_tokens=False).input_ids
    assert ids == [tokenizer.convert_tokens_to_ids("<think>"), tokenizer.convert_tokens_to_ids("</think>")]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think></think>"


@pytest.mark.parametrize(
    "family, bos, eos, pad",
    [
        ("llama", "<|begin_of_text|>", "<|end_of_text|>", None),
        ("qwen3_5", None, "<|im_end|>", "<|endoftext|>"),
        ("gpt_oss", "<|startoftext|>", "<|return|>", "<|endoftext|>"),
    ],
)
def test_token_roles_follow_the_real_tokenizers(tokenizers_by_family, family, bos, eos, pad):
    tokenizer = tokenizers_by_family[family]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (bos, eos, pad)
    assert len(tokenizer) == 512


def test_llama_prepends_bos_like_the_real_tokenizer(tokenizers_by_family):
    tokenizer = tokenizers_by_family["llama"]
    with_bos = tokenizer("hello").input_ids
    assert with_bos[0] == 0
    assert tokenizer("hello", add_special_tokens=False).input_ids == with_bos[1:]


@pytest.mark.parametrize("family", tiny.MODEL_TYPES)
def test_real_chat_template_is_attached(tokenizers_by_family, family):
    expected = (REALWORLD / "chat_templates" / tiny.CHAT_TEMPLATE_FILES[family]).read_text()
    assert tokenizers_by_family[family].chat_template == expected


def _expected_rendering(family: str) -> str:
    if family == "llama":
        return (
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
            "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 3?<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n2 + 3 = 5.<|eot_id|>"
        )
    if family == "qwen3_5":
        return (
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n2 + 3 = 5.<|im_end|>\n"
        )
    today = datetime.date.today().strftime("%Y-%m-%d")
    return (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {today}\n\nReasoning: medium\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>"
        "<|start|>user<|message|>What is 2 + 3?<|end|>"
        "<|start|>assistant<|channel|>final<|message|>2 + 3 = 5.<|return|>"
    )


@pytest.mark.parametrize("family", tiny.MODEL_TYPES)
def test_chat_template_renders_and_round_trips(tokenizers_by_family, family):
    tokenizer = tokenizers_by_family[family]
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert rendered == _expected_rendering(family)
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == rendered
    for token in tiny.SPECIAL_TOKENS[family]:
        assert ids.count(tokenizer.convert_tokens_to_ids(token)) == rendered.count(token)


def test_gpt_oss_thinking_goes_to_the_analysis_channel(tokenizers_by_family):
    conversation = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5", "thinking": "2 + 3 = 5"},
    ]
    rendered = tokenizers_by_family["gpt_oss"].apply_chat_template(conversation, tokenize=False)
    assert rendered.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>2 + 3 = 5<|end|>"
        "<|start|>assistant<|channel|>final<|message|>5<|return|>"
    )


def test_tokenizer_training_is_deterministic(tokenizers_by_family):
    again = tiny.build_tokenizer("llama")
    assert again.backend_tokenizer.to_str() == tokenizers_by_family["llama"].backend_tokenizer.to_str()


# --- checkpoints ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model_type, auto_class, model_class",
    [
        ("llama", AutoModelForCausalLM, "LlamaForCausalLM"),
        ("qwen3_5", AutoModelForImageTextToText, "Qwen3_5ForConditionalGeneration"),
        ("gpt_oss", AutoModelForCausalLM, "GptOssForCausalLM"),
    ],
)
def test_checkpoint_loads_offline_and_runs_forward(checkpoints, model_type, auto_class, model_class):
    path = checkpoints[model_type]
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"} <= {
        entry.name for entry in Path(path).iterdir()
    }
    model = auto_class.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert type(model).__name__ == model_class
    assert sum(parameter.numel() for parameter in model.parameters()) < 1_000_000

    ids = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (1, ids.shape[1], 512)
    assert torch.isfinite(out.loss)


def test_reloaded_tokenizer_encodes_like_the_built_one(checkpoints, tokenizers_by_family):
    # AutoTokenizer swaps in Qwen3_5Tokenizer (its own pre-tokenizer) for qwen3_5 checkpoints.
    text = "What is 12 + 345?  Hello\n\n world\t\tCafé <think>x</think> don't"
    for family, path in checkpoints.items():
        reloaded = AutoTokenizer.from_pretrained(path, local_files_only=True)
        assert reloaded(text).input_ids == tokenizers_by_family[family](text).input_ids, family


def test_qwen3_5_checkpoint_keeps_a_working_vision_tower(checkpoints):
    path = checkpoints["qwen3_5"]
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as weights:
        assert any(key.startswith("model.visual.") for key in weights.keys())
    model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True)
    # <|im_start|> x <|vision_start|> <|image_pad|> <|vision_end|> y <|im_end|>: a 2x2 patch grid
    # merges (spatial_merge_size 2) into the one image token.
    input_ids = torch.tensor([[1, 100, 3, 5, 4, 120, 2]])
    grid = torch.tensor([[1, 2, 2]])
    torch.manual_seed(0)
    pixels = torch.randn(4, 3 * 2 * 16 * 16)

    def logits(pixel_values):
        return model(
            input_ids=input_ids,
            pixel_values=pixel_values,
            image_grid_thw=grid,
            mm_token_type_ids=(input_ids == 5).long(),
        ).logits

    assert not torch.allclose(logits(pixels), logits(2 * pixels))


@pytest.mark.parametrize(
    "model_type, eos, pad",
    [("llama", 1, None), ("qwen3_5", [2, 0], 0), ("gpt_oss", [2, 1], 1)],
)
def test_generation_config_stops_on_the_real_end_tokens(checkpoints, model_type, eos, pad):
    model = tiny.AUTO_MODEL_CLASSES[model_type].from_pretrained(checkpoints[model_type], local_files_only=True)
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (eos, pad)


@pytest.mark.parametrize("model_type", tiny.MODEL_TYPES)
def test_build_is_deterministic_per_seed(tmp_path, model_type):
    def weights(seed: int, name: str) -> bytes:
        return (Path(tiny.build_tiny_model(model_type, tmp_path / name, seed=seed)) / "model.safetensors").read_bytes()

    first = weights(0, "a")
    assert weights(0, "b") == first
    assert weights(1, "c") != first


def test_ensure_tiny_reuses_and_rebuilds_when_inputs_change(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    path = Path(tiny.ensure_tiny("llama", root=root))
    built_at = (path / "model.safetensors").stat().st_mtime_ns
    assert tiny.ensure_tiny("llama", root=root) == str(path)
    assert (path / "model.safetensors").stat().st_mtime_ns == built_at
    assert [entry.name for entry in root.iterdir()] == [path.name]  # no staging leftovers

    samples = tmp_path / "samples"
    shutil.copytree(tiny.SAMPLES_DIR, samples)
    with (samples / "alpaca.jsonl").open("a") as handle:
        handle.write('{"instruction": "Say hi.", "input": "", "output": "hi", "text": "hi"}\n')
    monkeypatch.setattr(tiny, "SAMPLES_DIR", samples)
    assert tiny.ensure_tiny("llama", root=root) != str(path)
