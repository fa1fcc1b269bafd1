"""Sample generations (single process and 2-process FSDP2 lockstep) and scripts/chat.py on tiny and real exports; the
one-line refusals of chat.py, show_run.py and evaluate.py for a wrong folder or option."""

from __future__ import annotations

import builtins
import importlib.util
import json
import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import REPO_ROOT, bin_path, free_port, run_command
from worker_processes import spawn
from sft_recipes.errors import one_line_refusals
from sft_recipes.reporting.load_export import export_kind, load_export
from sft_recipes.config import load_recipe
from sft_recipes.data.formats import FORMATS, Tokenization
from sft_recipes.reporting.samples import (
    BEFORE_FILE, BaseSamplesCallback, chat_prompt_ids, default_sample_prompts, generate_answers, greedy_generate,
    prompt_ids, prompt_style, random_stand_in, samples_markdown, stop_token_ids, write_samples,
)
from sft_recipes.tiny import ensure_tiny

PROMPTS = ["What is 2 + 3?", "Name a colour."]
MAX_NEW = 8


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_script", REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_chat_script():
    return load_script("chat")


@pytest.fixture(scope="module")
def tiny_llama():
    path = ensure_tiny("llama")
    return path, AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


# ── Prompts and the markdown ──────────────────────────────────────────────────────────────────


def test_default_prompts_prefer_held_out_rows_and_read_user_turns():
    train = [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "train q"}]}]
    held_out = [{"messages": [{"role": "user", "content": f"eval q{i}"}]} for i in range(5)]
    assert default_sample_prompts([(held_out, "messages")], [(train, "messages")]) == ["eval q0", "eval q1", "eval q2"]
    assert default_sample_prompts([], [(train, "messages")]) == ["train q"]
    alpaca = [{"instruction": "Add.", "input": "2, 3", "output": "5"}, {"instruction": "Hi.", "output": "Hello"}]
    assert default_sample_prompts([], [(alpaca, "alpaca")], count=2) == ["Add.\n\n2, 3", "Hi."]
    assert default_sample_prompts([], [([{"text": "plain"}], "text")]) == []


def test_a_mixture_s_default_prompts_come_from_its_sources_in_turn():
    alpaca = [{"instruction": f"alpaca q{i}", "output": "a"} for i in range(3)]
    chat = [{"messages": [{"role": "user", "content": f"chat q{i}"}]} for i in range(3)]
    assert default_sample_prompts([], [(alpaca, "alpaca"), (chat, "messages")]) == ["alpaca q0", "chat q0", "alpaca q1"]
    # A source without user turns (plain text) gives none; the others fill in.
    assert default_sample_prompts([], [([{"text": "t"}], "text"), (chat, "messages")], count=2) == ["chat q0", "chat q1"]


def test_markdown_puts_before_and_after_side_by_side():
    text = samples_markdown(["Q1"], ["old\nanswer"], ["new"])
    assert text == ("# Sample generations (greedy, chat template)\n\n## 1. Prompt\n\n> Q1\n\n"
                    "**Before training (base model)**\n\n> old\n> answer\n\n**After training (reloaded export)**\n\n> new\n")


def test_samples_are_asked_in_the_prompt_format_the_run_trains():
    recipes = REPO_ROOT / "recipes"
    assert prompt_style(load_recipe(recipes / "tiny" / "llama8b.yaml").data) == "alpaca"
    assert prompt_style(load_recipe(recipes / "tiny" / "qwen27b.yaml").data) == "chat"
    assert prompt_style(load_recipe(recipes / "examples" / "tiny_llama_mixture.yaml").data) == "chat"  # two styles
    assert prompt_style(load_recipe(recipes / "tiny" / "llama8b.yaml", {"dataset_format": "alpaca_chat"}).data) == "chat"


def test_an_alpaca_sample_prompt_is_the_training_rows_prompt_token_for_token(tiny_llama):
    _, _, tokenizer = tiny_llama
    row = {"instruction": ["What is 2 + 3?"], "input": [None], "output": ["5"]}
    trained = FORMATS["alpaca"]._tokens(row, tokenizer, Tokenization(max_length=None))
    ids, labels = trained["input_ids"][0], trained["labels"][0]
    asked = prompt_ids(tokenizer, "What is 2 + 3?", "alpaca")
    prompt_length = labels.index(next(label for label in labels if label != -100))
    assert asked == ids[:prompt_length]  # what the model saw before every answer it learned, nothing else
    assert tokenizer.decode(asked).endswith("### Instruction:\nWhat is 2 + 3?\n\n### Response:\n")
    assert prompt_ids(tokenizer, "Hi", "chat") == chat_prompt_ids(tokenizer, "Hi")
    assert prompt_ids(tokenizer, "Once upon", "text") == tokenizer("Once upon")["input_ids"]


def test_markdown_names_the_prompt_format_and_says_when_the_model_is_a_random_stand_in():
    note = random_stand_in("tiny:llama")
    assert "tiny:llama is a tiny randomly initialised stand-in: its answers are meaningless by design" in note
    assert random_stand_in("meta-llama/Llama-3.1-8B") is None and random_stand_in(".cache/smollm2/x") is None
    text = samples_markdown(["Q1"], None, ["a"], style="alpaca", stand_in_note=note)
    assert text.startswith("# Sample generations (greedy, alpaca prompt `### Instruction: ... ### Response:`)\n\n"
                           f"**Note:** {note}\n\n## 1. Prompt")


# ── Greedy generation ─────────────────────────────────────────────────────────────────────────


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def test_greedy_loop_equals_transformers_generate(tiny_llama):
    _, model, tokenizer = tiny_llama
    prompt_ids = chat_prompt_ids(tokenizer, PROMPTS[0])
    assert prompt_ids == tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}],
                                                       add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    [ours] = greedy_generate(model, [prompt_ids], MAX_NEW, stop_token_ids(model, tokenizer), pad_id(tokenizer))
    reference = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_NEW, do_sample=False,
                               pad_token_id=pad_id(tokenizer))[0, len(prompt_ids):]
    assert ours == reference.tolist() and len(ours) >= 1
    assert model.training is False


def test_prompts_batched_with_left_padding_answer_as_alone(tiny_llama):
    _, model, tokenizer = tiny_llama
    prompts_ids = [chat_prompt_ids(tokenizer, "Hi"), chat_prompt_ids(tokenizer, "Tell me a much longer story now.")]
    assert len(prompts_ids[0]) < len(prompts_ids[1])
    stops = stop_token_ids(model, tokenizer)
    alone = [greedy_generate(model, [ids], MAX_NEW, stops, pad_id(tokenizer))[0] for ids in prompts_ids]
    assert greedy_generate(model, prompts_ids, MAX_NEW, stops, pad_id(tokenizer)) == alone


def test_greedy_stops_at_a_stop_token(tiny_llama):
    _, model, tokenizer = tiny_llama
    prompt_ids = chat_prompt_ids(tokenizer, PROMPTS[0])
    first = greedy_generate(model, [prompt_ids], 1, set(), pad_id(tokenizer))[0][0]
    assert greedy_generate(model, [prompt_ids], MAX_NEW, {first}, pad_id(tokenizer)) == [[first]]


class State:
    def __init__(self, global_step):
        self.global_step, self.is_world_process_zero = global_step, True


class Args:
    def __init__(self, output_dir):
        self.output_dir = str(output_dir)


def test_samples_before_and_after_end_in_samples_md(tiny_llama, tmp_path):
    _, model, tokenizer = tiny_llama
    callback = BaseSamplesCallback(PROMPTS, MAX_NEW)
    callback.on_train_begin(Args(tmp_path), State(global_step=3), None, model=model, processing_class=tokenizer)
    assert not (tmp_path / BEFORE_FILE).exists()  # a resumed run's model is no longer the base
    callback.on_train_begin(Args(tmp_path), State(global_step=0), None, model=model, processing_class=tokenizer)
    before = json.loads((tmp_path / BEFORE_FILE).read_text())
    expected = generate_answers(model, tokenizer, PROMPTS, MAX_NEW)
    assert before == {"prompts": PROMPTS, "answers": expected}
    text = write_samples(tmp_path, PROMPTS, model, tokenizer, MAX_NEW).read_text()
    assert text == samples_markdown(PROMPTS, expected, expected)


def _lockstep_worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    forward_calls = []
    model.register_forward_hook(lambda *_: forward_calls.append(1))
    answers = generate_answers(model, tokenizer, PROMPTS, MAX_NEW, in_lockstep=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"answers": answers, "forward_calls": len(forward_calls)}, f)
    dist.destroy_process_group()


@pytest.mark.fsdp
def test_lockstep_generation_under_fsdp2_matches_one_process(tiny_llama, tmp_path):
    path, model, tokenizer = tiny_llama
    spawn(_lockstep_worker, (free_port(), path, str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]  # same answers, same number of forward calls: no rank waits alone
    assert ranks[0]["answers"] == generate_answers(model, tokenizer, PROMPTS, MAX_NEW)


# ── Chat with the export ──────────────────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def lora_export(tiny_llama, tmp_path_factory):
    """A tiny Llama LoRA export as the run writes it: adapter_model.safetensors + adapter_config.json + tokenizer."""
    path, _, tokenizer = tiny_llama
    out = tmp_path_factory.mktemp("lora_export")
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))  # as if trained
    peft_model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_chat_answers_once_from_a_full_export(tiny_llama, capsys):
    path, model, tokenizer = tiny_llama
    assert export_kind(path) == "full"
    assert load_chat_script().main([path, "--prompt", PROMPTS[0], "--max_new_tokens", str(MAX_NEW)]) == 0
    assert capsys.readouterr().out.strip() == generate_answers(model, tokenizer, PROMPTS[:1], MAX_NEW)[0]


def test_chat_answers_once_from_base_plus_adapter(tiny_llama, lora_export, capsys):
    _, base, tokenizer = tiny_llama
    assert export_kind(lora_export) == "adapter"
    model, _ = load_export(lora_export)
    expected = generate_answers(model, tokenizer, PROMPTS[:1], MAX_NEW)[0]
    assert expected != generate_answers(base, tokenizer, PROMPTS[:1], MAX_NEW)[0]  # the adapter is applied
    assert load_chat_script().main([str(lora_export), "--prompt", PROMPTS[0], "--max_new_tokens", str(MAX_NEW)]) == 0
    assert capsys.readouterr().out.strip() == expected


def test_interactive_chat_keeps_the_conversation(tiny_llama, monkeypatch, capsys):
    path, model, tokenizer = tiny_llama
    typed = iter(["hello", "and again", ""])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(typed))
    assert load_chat_script().main([path, "--max_new_tokens", "4"]) == 0
    assert capsys.readouterr().out.count("model> ") == 2


def test_chat_refuses_a_folder_without_an_export(tmp_path, capsys):
    assert load_chat_script().main([str(tmp_path), "--prompt", "hi"]) == 2
    assert "holds no exported model (no config.json, no adapter_config.json)" in capsys.readouterr().err


def prompts_chat_generates_from(model, tokenizer, monkeypatch) -> list[str]:
    """The decoded prompt of every `generate` call chat.py makes from now on (appended as they come)."""
    prompts = []
    real_generate = type(model).generate

    def generate(self, **kwargs):
        prompts.append(tokenizer.decode(kwargs["input_ids"][0]))
        return real_generate(self, **kwargs)

    monkeypatch.setattr(type(model), "generate", generate)
    return prompts


def test_chat_gives_the_tools_file_to_the_template(tiny_llama, tmp_path, capsys, monkeypatch):
    path, model, tokenizer = tiny_llama
    schema = {"name": "calculate_triangle_area", "description": "Calculate the area of a triangle.",
              "parameters": {"type": "object", "properties": {"base": {"type": "integer"}}, "required": ["base"]}}
    (tmp_path / "tools.json").write_text(json.dumps([schema]))
    prompts = prompts_chat_generates_from(model, tokenizer, monkeypatch)
    chat = load_chat_script()
    assert chat.main([path, "--tools", str(tmp_path / "tools.json"), "--prompt", "Area?", "--max_new_tokens", "2"]) == 0
    tools = [{"type": "function", "function": schema}]
    assert prompts == [tokenizer.apply_chat_template([{"role": "user", "content": "Area?"}], tools=tools,
                                                     add_generation_prompt=True, tokenize=False)]
    assert '"name": "calculate_triangle_area"' in prompts[0]  # Llama-3.1 puts the schemas in the user turn
    capsys.readouterr()
    (tmp_path / "bad.json").write_text('{"name": "x"}')
    assert chat.main([path, "--tools", str(tmp_path / "bad.json"), "--prompt", "Area?"]) == 2
    assert capsys.readouterr().err.startswith(f"error: --tools {tmp_path / 'bad.json'}: the tools are not a list of "
                                              "JSON schemas; give a JSON list of function schemas")


def test_chat_opens_with_the_system_prompt_once_and_interactively(tiny_llama, capsys, monkeypatch):
    path, model, tokenizer = tiny_llama
    prompts = prompts_chat_generates_from(model, tokenizer, monkeypatch)
    chat = load_chat_script()
    system = {"role": "system", "content": "Answer in one word."}
    assert chat.main([path, "--system", system["content"], "--prompt", "Capital?", "--max_new_tokens", "2"]) == 0
    assert prompts == [tokenizer.apply_chat_template([system, {"role": "user", "content": "Capital?"}],
                                                     add_generation_prompt=True, tokenize=False)]
    assert "Answer in one word." in prompts[0]
    typed = iter(["hello", "again", ""])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(typed))
    assert chat.main([path, "--system", system["content"], "--max_new_tokens", "2"]) == 0
    assert [prompt.count("Answer in one word.") for prompt in prompts[1:]] == [1, 1]  # once, at the start of each turn
    capsys.readouterr()


# ── A wrong folder or option: one `error:` line, exit 2 (chat.py, show_run.py, evaluate.py) ─────────────────────


@pytest.fixture
def finished_run(tmp_path):
    """An output_dir as far as the refusals read it: a full export's config.json, run_summary.json, and the
    Trainer's checkpoint-4 (trainer_state.json, no export)."""
    out = tmp_path / "run"
    (out / "checkpoint-4").mkdir(parents=True)
    for name in ("config.json", "run_summary.json", "checkpoint-4/trainer_state.json"):
        (out / name).write_text("{}")
    return out


def test_chat_refuses_a_length_or_temperature_out_of_range_in_one_line(finished_run, capsys, monkeypatch):
    chat = load_chat_script()
    tokens = "give the most tokens one answer may have (default 256)"
    temperature = "give 0 for greedy answers (the default), or e.g. 0.7 to sample"
    lines = {
        "--max_new_tokens=-5": f"error: argument --max_new_tokens: -5 is not a whole number >= 1: {tokens}",
        "--max_new_tokens=0": f"error: argument --max_new_tokens: 0 is not a whole number >= 1: {tokens}",
        "--max_new_tokens=many": f"error: argument --max_new_tokens: many is not a whole number >= 1: {tokens}",
        "--temperature=-1": f"error: argument --temperature: -1 is not a number >= 0: {temperature}",
        "--temperature=nan": f"error: argument --temperature: nan is not a number >= 0: {temperature}",
        "--temprature=1": "error: unrecognized arguments: --temprature=1 (see scripts/chat.py --help)",
    }
    for option, line in lines.items():  # refused by argparse, before the (fake) export is read
        with pytest.raises(SystemExit) as refused:
            chat.main([str(finished_run), "--prompt", "Hi", option])
        assert (refused.value.code, capsys.readouterr().err) == (2, line + "\n")
    # 0 is taken (greedy, the default): parsed, then the export is loaded
    monkeypatch.setattr(chat, "load_export", lambda *args: (_ for _ in ()).throw(SystemExit("parsed")))
    with pytest.raises(SystemExit, match="parsed"):
        chat.main([str(finished_run), "--prompt", "Hi", "--temperature", "0", "--max_new_tokens", "1"])


def test_chat_refuses_base_model_for_a_full_export(finished_run, capsys):
    chat = load_chat_script()
    assert chat.main([str(finished_run), "--base_model", "nope/nope", "--prompt", "Hi"]) == 2
    assert capsys.readouterr().err == (f"error: --base_model puts an adapter onto a base, and {finished_run} holds a "
                                       "whole model (config.json, no adapter_config.json), which loads as it is: drop "
                                       "--base_model\n")


def test_a_folder_that_is_not_a_run_is_named_for_what_it_is(finished_run, tmp_path, capsys):
    """No folder there, or a Trainer checkpoint inside a run's output_dir (finished or not): said so, with the way
    out, by chat.py, show_run.py and evaluate.py alike; no blank line above the `error:` line."""
    chat, show, evaluate = load_chat_script(), load_script("show_run"), load_script("evaluate")
    missing, checkpoint = tmp_path / "nope", finished_run / "checkpoint-4"
    unfinished = tmp_path / "unfinished" / "checkpoint-2"
    shutil.copytree(checkpoint, unfinished)
    exported = f"{checkpoint} is a Trainer checkpoint (what a resume starts from); the run's export is in its output_dir:"
    not_yet = (f"{unfinished} is a Trainer checkpoint (what a resume starts from), and its output_dir {unfinished.parent}"
               " holds no export yet (the run did not finish): rerun the run's command, which resumes from its last "
               "checkpoint, then")
    lines = {
        (chat, missing): f"error: {missing} is not a folder here: pass a run's output_dir, e.g. make chat OUT=outputs/demo",
        (show, missing): f"error: {missing} is not a folder here: pass a run's output_dir, e.g. make show OUT=outputs/demo",
        (chat, checkpoint): f"error: {exported} make chat OUT={finished_run}",
        (show, checkpoint): f"error: {exported} make show OUT={finished_run}",
        (evaluate, checkpoint): f"error: {exported} pass {finished_run}",
        (chat, unfinished): f"error: {not_yet} make chat OUT={unfinished.parent}",
        (show, unfinished): f"error: {not_yet} make show OUT={unfinished.parent}",
        (show, tmp_path): f"error: {tmp_path} holds no finished run (no readable run_summary.json and export): pass a "
                          "run's output_dir, e.g. make show OUT=outputs/demo",
    }
    for (script, folder), line in lines.items():
        if script is chat:
            code = chat.main([str(folder), "--prompt", "Hi"])
        elif script is show:
            code = show.main([str(folder)])
        else:
            code = one_line_refusals(lambda: evaluate.main([str(folder), "--tasks", "alpaca_answers"]))
        assert (code, capsys.readouterr().err) == (2, line + "\n")


@pytest.mark.slow  # two interpreters that import transformers
def test_the_scripts_print_no_blank_line_above_their_error_line(tmp_path):
    missing = tmp_path / "nope"
    shown = run_command([bin_path("python"), "scripts/show_run.py", str(missing)])
    assert (shown.returncode, shown.stderr) == (
        2, f"error: {missing} is not a folder here: pass a run's output_dir, e.g. make show OUT=outputs/demo\n")
    scored = run_command([bin_path("python"), "scripts/evaluate.py", str(missing), "--tasks", "alpaca_answers",
                          "--backend", "tgi"])
    assert (scored.returncode, scored.stderr) == (
        2, "error: --backend 'tgi' is not offered: use --backend hf (transformers, the default) or --backend vllm "
           "(lm-eval's vLLM model; pip install vllm)\n")


def test_show_run_lines_up_its_columns(tiny_llama, tmp_path, capsys):
    path, _, _ = tiny_llama
    out = shutil.copytree(path, tmp_path / "run")
    (out / "run_summary.json").write_text(json.dumps({"distributed": "1 process on cpu", "steps": 1,
                                                      "seconds_per_step": 0.5, "final_loss": 6.25,
                                                      "export_max_logit_diff": 0.0}))
    for name in ("training_curves.png", "samples.md", "README.md", "train.log"):
        (out / name).write_text("")
    assert load_script("show_run").main([str(out)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert [line for line in lines if not re.fullmatch(r"  \S.{17} \S.*", line) and not line.startswith(" " * 21)] == []
    assert "\n".join(lines[-6:-1]) == (f"  summary            {out}/run_summary.json\n"
                                       f"  curves picture     {out}/training_curves.png\n"
                                       f"  sample answers     {out}/samples.md (before and after training)\n"
                                       f"  model card         {out}/README.md\n"
                                       f"  console log        {out}/train.log")
