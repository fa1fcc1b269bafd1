"""Benchmark scores with lm-evaluation-harness: the shipped tasks, refusals before training, the in-run comparison of
base and tuned with its gate, and scripts/evaluate.py scoring the same export to the same numbers."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from conftest import (
    REALWORLD, REPO_ROOT, TINY_LLAMA_RECIPE, a_proxy_that_closes_every_connection, bin_path, free_port, launch_sft,
    read_summary, run_command,
)
from fault_helpers import rank_exit_codes
from sft_recipes.errors import RecipeError, one_line_refusals
from sft_recipes.loading import resolve_model_path
from sft_recipes.preflight_launch import recipe_refusal
from sft_recipes.scores.compare import Comparison, markdown_table, regression_refusal
from sft_recipes.scores.tasks import SHIPPED_TASKS_DIR, parse_tasks

FAKE_TOKEN = "hf_benchmark_gate_test_token"
# Training that makes the tiny twin regress on alpaca_answers (its first 6 rows, each with its wrong answer):
# measured in docs/evaluation.md
WRONG_ROWS, REGRESSION_STEPS, REGRESSION_LEARNING_RATE = 6, 60, 0.01


def _make_task_data():
    spec = importlib.util.spec_from_file_location("make_task_data", REPO_ROOT / "evals" / "make_task_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_tasks_parse_and_read_the_real_data_offline():
    assert sorted(p.name for p in SHIPPED_TASKS_DIR.glob("*.yaml")) == [
        "alpaca_answers.yaml", "gsm8k_local.yaml", "ifeval_local.yaml"]
    for name in ("alpaca_answers", "gsm8k_local"):
        path = SHIPPED_TASKS_DIR / f"{name}.yaml"
        assert yaml.safe_load(path.read_text())["task"] == name  # plain YAML (no !function) named as its file
    alpaca, gsm8k = parse_tasks(["alpaca_answers", {"task": "gsm8k_local", "limit": 5,
                                                     "metric": "exact_match,flexible-extract"}], limit=8)
    assert (alpaca.name, alpaca.limit, alpaca.num_fewshot, alpaca.metric) == ("alpaca_answers", 8, None, None)
    assert (gsm8k.name, gsm8k.limit, gsm8k.metric) == ("gsm8k_local", 5, "exact_match,flexible-extract")
    assert gsm8k.config["dataset_kwargs"]["data_files"] == {
        "test": str(REALWORLD / "eval" / "openai__gsm8k.test.jsonl")}  # the whole real test split, path made absolute
    rows = (REALWORLD / "eval" / "openai__gsm8k.test.jsonl").read_text().splitlines()
    assert len(rows) == 1319 and json.loads(rows[0])["answer"].endswith("#### 18")
    # alpaca_answers' rows are what evals/make_task_data.py writes from the real alpaca rows
    shipped = [json.loads(line) for line in (SHIPPED_TASKS_DIR / "data" / "alpaca_answers.jsonl").read_text().splitlines()]
    assert shipped == _make_task_data().task_rows() and len(shipped) == 40
    assert shipped[1] == {"instruction": "Calculate the average of [2, 4, 5, 7, 8].",
                          "choices": ["1. Solar energy\n2. Wind energy\n3. Hydropower\n4. Geothermal energy\n5. "
                                      "Biomass energy", "The average of [2, 4, 5, 7, 8] is 5.4."], "label": 1}


def test_bad_tasks_are_refused_with_what_to_write(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("task: broken\nmetric_list: [\n")
    bad_metric = tmp_path / "bad_metric.yaml"
    bad_metric.write_text((SHIPPED_TASKS_DIR / "alpaca_answers.yaml").read_text().replace("metric: acc_norm",
                                                                                          "metric: acc_nrom"))
    refusals = {
        "gsm8k_locl": "unknown task 'gsm8k_locl' -- not a task shipped in evals/tasks/ (alpaca_answers, gsm8k_local, "
                      "ifeval_local), "
                      "not one of lm-eval's tasks (closest: gsm8k_local",
        str(broken): f"task file {broken} does not parse (",
        str(bad_metric): f"task file {bad_metric}: metric 'acc_nrom' does not exist in lm-eval",
        str(tmp_path / "missing.yaml"): f"task file {tmp_path / 'missing.yaml'} does not exist",
    }
    for entry, message in refusals.items():
        with pytest.raises(ValueError) as err:
            parse_tasks([entry])
        assert message in str(err.value), str(err.value)
    with pytest.raises(ValueError, match=r"task 'alpaca_answers' reports no metric 'f1,none': it reports acc,none, "
                                         r"acc_norm,none \(metric,filter\)"):
        parse_tasks([{"task": "alpaca_answers", "metric": "f1"}])
    assert [t.name for t in parse_tasks(["gsm8k"])] == ["gsm8k"]  # lm-eval's registry task, by name (Hub data)
    # IFEval's checkers need packages lm-eval does not install and nltk data it cannot download offline
    with pytest.raises(ValueError, match=r"^eval_tasks: ifeval needs (immutabledict, langdetect: \.venv/bin/pip install "
                                         r"'lm-eval\[ifeval\]==0\.4\.13'|nltk's punkt_tab data)"):
        parse_tasks(["ifeval"])
    for shipped in ("ifeval_local", str(SHIPPED_TASKS_DIR / "ifeval_local.yaml")):  # refused before its file imports
        with pytest.raises(ValueError, match=r"^eval_tasks: ifeval needs "):
            parse_tasks([shipped])


def test_a_bad_task_is_refused_by_the_launch_preflight_before_any_process_starts():
    # what `make train` checks before `accelerate launch` (and every rank's lint again at start): one problem line
    problem = recipe_refusal("accelerate_configs/fsdp2_cpu.yaml", str(TINY_LLAMA_RECIPE),
                             ["--eval_tasks", "[alpaca_answers, {task: gsm8k_local, metric: accuracy}]"], None, False)
    assert problem == (f"{TINY_LLAMA_RECIPE}: eval_tasks: task 'gsm8k_local' reports no metric 'accuracy,none': it "
                       "reports exact_match,strict-match, exact_match,flexible-extract (metric,filter).")
    problem = recipe_refusal("accelerate_configs/fsdp2_cpu.yaml", str(TINY_LLAMA_RECIPE),
                             ["--eval_tasks", "[alpaca_answers]", "--eval_max_regression", "{ifeval: 0.1}"], None, False)
    assert problem == (f"{TINY_LLAMA_RECIPE}: eval_max_regression names ifeval, which eval_tasks does not score (its "
                       "tasks: alpaca_answers).")


@pytest.mark.slow
def test_a_training_run_without_eval_tasks_never_imports_lm_eval():
    # Everything scripts/sft.py imports, the run's finish and scoring modules, and the lint of a recipe without tasks
    probe = ("import sys; sys.path.insert(0, 'scripts'); import sft; from sft_recipes.config import load_recipe; "
             "from sft_recipes.lint import LintContext, lint_recipe; "
             "import sft_recipes.run.finish, sft_recipes.run.scoring, sft_recipes.reporting.run_end; "
             f"lint_recipe(load_recipe('{TINY_LLAMA_RECIPE}', []), LintContext(world_size=2, has_accelerator=False)); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'lm_eval'))")
    result = run_command([sys.executable, "-c", probe], launcher="real")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_a_few_shot_count_asked_for_overrides_a_task_files_own_zero(monkeypatch):
    # gsm8k_local.yaml says num_fewshot: 0, and lm-eval alone never overrides a config's 0 with its num_fewshot
    # argument (it only logs that it ignored it): the entry's count must reach the prompts.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sft_recipes.scores import import_lm_eval
    from sft_recipes.scores.harness import EvalSettings, score_model

    import_lm_eval()  # lm-eval without the environment its __init__ writes
    from lm_eval.models.huggingface import HFLM

    contexts = []
    real_generate_until = HFLM.generate_until

    def recording_generate_until(self, requests, *args, **kwargs):
        contexts.extend(request.args[0] for request in requests)
        return real_generate_until(self, requests, *args, **kwargs)

    monkeypatch.setattr(HFLM, "generate_until", recording_generate_until)
    base = resolve_model_path("tiny:llama")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(base).eval(), AutoTokenizer.from_pretrained(base)
    for fewshot in (None, 2):
        task = parse_tasks([{"task": "gsm8k_local", "limit": 1, **({"num_fewshot": fewshot} if fewshot else {})}])
        score_model(model, tokenizer, task, EvalSettings(batch_size=1, max_gen_toks=1), None, "tiny")
    zero_shot, two_shot = contexts
    assert zero_shot.startswith("Question: Janet’s ducks lay 16 eggs per day.") and zero_shot.endswith("\nAnswer:")
    assert zero_shot.count("Question:") == 1 and zero_shot.count("#### ") == 0
    assert two_shot.endswith(zero_shot) and two_shot.count("Question:") == 3 and two_shot.count("#### ") == 2


def test_the_gate_and_its_refusal_line():
    rows = [Comparison("alpaca_answers", "acc,none", 0.5, 0.375, 0.1, 0.125, 8, 0.1),
            Comparison("gsm8k_local", "exact_match,strict-match", 0.0, 0.0, 0.0, 0.0, 2, 0.1)]
    assert [row.regressed for row in rows] == [True, False]
    assert regression_refusal(rows, "out") == (
        "the fine-tuned model regressed: alpaca_answers acc,none fell from 0.5000 (base) to 0.3750 (tuned), a drop of "
        "0.1250 where eval_max_regression allows 0.1000. The export stays in out, marked regressed in its README.md "
        "and run_summary.json, and was not pushed: change the data or the training, or raise eval_max_regression if "
        "the drop is acceptable")
    assert regression_refusal(rows[1:], "out") is None
    # a negative allowance demands a gain: no change at all fails it
    demanding = [Comparison("gsm8k_local", "exact_match,strict-match", 0.25, 0.25, 0.1, 0.1, 8, -0.05)]
    assert regression_refusal(demanding, "out").startswith(
        "the fine-tuned model regressed: gsm8k_local exact_match,strict-match went from 0.2500 (base) to 0.2500 "
        "(tuned), a change of +0.0000 where eval_max_regression -0.0500 demands a gain of at least 0.0500. The export")
    assert markdown_table(rows).splitlines()[2] == (
        "| alpaca_answers | acc,none | 0.5000 | 0.3750 | -0.1250 | ±0.1000 / ±0.1250 | 8 | **regressed** |")


def test_an_export_that_cannot_be_scored_is_one_refusal_and_stays(tmp_path):
    from sft_recipes.run.scoring import score_run

    export = tmp_path / "out"
    export.mkdir()
    (export / "config.json").write_text('{"model_type": "llama"}')  # an export whose weights are gone
    training = SimpleNamespace(eval_tasks=["alpaca_answers"], eval_limit=2, eval_num_fewshot=None,
                               per_device_eval_batch_size=2, eval_max_gen_toks=None, eval_apply_chat_template=False,
                               seed=0, eval_cache_dir=str(tmp_path / "cache"), eval_max_regression=None,
                               device="cpu")
    run = SimpleNamespace(recipe=SimpleNamespace(training=training, model=SimpleNamespace(model_name_or_path="x")))
    benchmarks = score_run(run, export)
    assert benchmarks.rows == [] and benchmarks.refusal.startswith("scoring the export on eval_tasks failed (")
    assert f"the export in {export} is kept and was not pushed" in benchmarks.refusal
    assert (export / "config.json").is_file()


@pytest.mark.fsdp
def test_run_scores_base_and_tuned_refuses_a_regression_and_evaluate_py_agrees(tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    # A model made to regress: trained on alpaca_answers' first 6 instructions, each paired with its WRONG choice (the
    # next row's answer), until it prefers the wrong answers; the gate allows a drop of 0.1. With push_to_hub set, a
    # push would be tried (and fail) if the gate let the run through.
    task_rows = [json.loads(line) for line in (SHIPPED_TASKS_DIR / "data" / "alpaca_answers.jsonl").read_text().splitlines()]
    wrong = tmp_path / "wrong_answers.jsonl"
    wrong.write_text("".join(json.dumps({"instruction": row["instruction"], "input": "",
                                         "output": row["choices"][1 - row["label"]]}) + "\n"
                             for row in task_rows[:WRONG_ROWS]) * 3)  # 18 rows: more than one global batch of 16
    store = tmp_path / "mlflow.db"
    # The Hub behind a proxy: the push is not refused at start (the proxy connects, not this machine), and would fail
    # at once if the gate let it through. HTTPS_PROXY, unlike HF_ENDPOINT, lets the warm launcher serve the run.
    with a_proxy_that_closes_every_connection() as proxy:
        result = launch_sft(TINY_LLAMA_RECIPE, "--max_steps", str(REGRESSION_STEPS), "--learning_rate",
                            str(REGRESSION_LEARNING_RATE), "--dataset_name", str(wrong), "--output_dir", str(out),
                            "--save_strategy", "'no'", "--sample_prompts", "[]",
                            "--eval_tasks", "[{task: alpaca_answers, limit: 6}, {task: gsm8k_local, limit: 2}]",
                            "--eval_max_gen_toks", "4", "--per_device_eval_batch_size", "4",
                            "--eval_cache_dir", str(cache), "--eval_max_regression", "{alpaca_answers: 0.1}",
                            "--push_to_hub", "true", "--hub_model_id", "me/tiny-benchmarks",
                            env={"HF_TOKEN": FAKE_TOKEN, "HTTPS_PROXY": proxy,
                                 "MLFLOW_TRACKING_URI": f"sqlite:///{store}"}, check=False)
    assert rank_exit_codes(result.stderr) == {0: 2, 1: 2}, result.stderr[-3000:]  # every rank refused
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    summary = read_summary(out)
    rows = summary["benchmarks"]["tasks"]
    alpaca, gsm8k = rows
    assert alpaca["tuned"] < alpaca["base"] - 0.1  # a real regression, beyond the allowance
    assert errors == [f"error: the fine-tuned model regressed: alpaca_answers acc,none fell from {alpaca['base']:.4f} "
                      f"(base) to {alpaca['tuned']:.4f} (tuned), a drop of {alpaca['base'] - alpaca['tuned']:.4f} where "
                      f"eval_max_regression allows 0.1000. The export stays in {out}, marked regressed in its README.md "
                      "and run_summary.json, and was not pushed: change the data or the training, or raise "
                      "eval_max_regression if the drop is acceptable"]
    assert "pushed" not in result.stdout and (out / "model.safetensors").is_file()  # the export stays
    assert [(r["task"], r["metric"], r["samples"], r["max_regression"], r["regressed"]) for r in rows] == [
        ("alpaca_answers", "acc,none", 6, 0.1, True), ("gsm8k_local", "exact_match,strict-match", 2, None, False)]
    assert summary["benchmarks"]["regressed"] is True and summary["benchmarks"]["error"] is None
    # the console says base against tuned before the closing line, and lm-eval's do_sample advice is not printed
    shown = [line for line in result.stdout.splitlines() if line.startswith(("[benchmarks]", "[train] "))]
    assert shown == [f"[benchmarks] alpaca_answers acc,none: base {alpaca['base']:.4f} -> tuned {alpaca['tuned']:.4f} "
                     f"({alpaca['change']:+.4f}) REGRESSED",
                     f"[benchmarks] gsm8k_local exact_match,strict-match: base {gsm8k['base']:.4f} -> tuned "
                     f"{gsm8k['tuned']:.4f} ({gsm8k['change']:+.4f})", shown[-1]] and shown[-1].startswith("[train] ")
    assert "Ensure 'do_sample=True'" not in result.stderr
    assert summary["benchmarks"]["settings"] == {
        "limit": None, "num_fewshot": None, "max_gen_toks": 4, "apply_chat_template": False,
        "per_task": {"alpaca_answers": {"limit": 6, "num_fewshot": None}, "gsm8k_local": {"limit": 2, "num_fewshot": None}}}
    for row in rows:
        assert row["change"] == pytest.approx(row["tuned"] - row["base"]) and row["base"] * 6 == round(row["base"] * 6)
    card = (out / "README.md").read_text()
    assert "**REGRESSED**: a task fell below the base by more than eval_max_regression allows" in card
    assert ("Scored with lm-evaluation-harness (the examples column counts what each task scored, each task's own "
            "few-shot setting, chat template off, answers of at most 4 tokens)") in card
    assert (f"| alpaca_answers | acc,none | {alpaca['base']:.4f} | {alpaca['tuned']:.4f} | {alpaca['change']:+.4f} | "
            f"±{alpaca['base_stderr']:.4f} / ±{alpaca['tuned_stderr']:.4f} | 6 | **regressed** |") in card
    assert f"| gsm8k_local | exact_match,strict-match | {gsm8k['base']:.4f} | {gsm8k['tuned']:.4f} |" in card
    assert (out / "benchmark_scores.png").read_bytes()[:4] == b"\x89PNG"
    assert len(list(cache.glob("*.json"))) == 4  # two tasks x two models
    from mlflow import MlflowClient

    mlflow_run = MlflowClient(f"sqlite:///{store}").get_run(summary["mlflow_run_id"])
    assert {key: value for key, value in mlflow_run.data.metrics.items() if key.startswith("benchmark/")} == {
        f"benchmark/{row['task']}/{row['metric'].replace(',', '_')}/{which}": row[which]
        for row in rows for which in ("base", "tuned", "change")}
    assert "benchmark_scores.png" in [a.path for a in MlflowClient(f"sqlite:///{store}").list_artifacts(mlflow_run.info.run_id)]

    # scripts/evaluate.py on the same export and on the base, without the cache: the run's numbers
    scored = run_command([bin_path("python"), "scripts/evaluate.py", str(out), "--tasks",
                          "alpaca_answers", "--limit", "6", "--batch_size", "4", "--output", str(tmp_path / "e.json")])
    assert scored.returncode == 0, scored.stderr[-3000:]
    tasks = json.loads((tmp_path / "e.json").read_text())["tasks"]
    assert tasks["alpaca_answers"]["value"] == alpaca["tuned"]
    assert tasks["alpaca_answers"]["stderr"] == alpaca["tuned_stderr"]
    assert re.search(rf"^alpaca_answers\s+acc,none\s+{alpaca['tuned']:.4f}\s", scored.stdout, re.M), scored.stdout

    # the base, by its folder: without the cache the run's base score again; with the run's cache, read from it
    base = resolve_model_path("tiny:llama")
    for cache_args in ([], ["--cache_dir", str(cache)]):
        scored = run_command([bin_path("python"), "scripts/evaluate.py", base, "--tasks", "alpaca_answers", "--limit",
                              "6", "--batch_size", "4", "--max_gen_toks", "4", "--output", str(tmp_path / "b.json"),
                              *cache_args])
        assert scored.returncode == 0, scored.stderr[-3000:]
        assert json.loads((tmp_path / "b.json").read_text())["tasks"]["alpaca_answers"]["value"] == alpaca["base"]
        assert ("alpaca_answers: " in scored.stderr and "from the cache" in scored.stderr) == bool(cache_args)

    shown = run_command([bin_path("python"), "scripts/show_run.py", str(out)])
    assert (f"  benchmarks         alpaca_answers acc,none: base {alpaca['base']:.4f} -> tuned {alpaca['tuned']:.4f} "
            f"({alpaca['change']:+.4f}) REGRESSED\n") in shown.stdout, shown.stdout[-2000:]


def test_demo_real_scores_base_and_tuned_and_shows_them():
    from sft_recipes.config import load_recipe

    training = load_recipe(REPO_ROOT / "recipes" / "smollm2-135m.yaml", planning=True).training
    tasks = parse_tasks(training.eval_tasks, training.eval_limit, training.eval_num_fewshot)
    assert [(t.name, t.limit) for t in tasks] == [("alpaca_answers", None), ("gsm8k_local", 10)]
    assert (training.eval_apply_chat_template, training.eval_max_gen_toks) == (True, 192)
    dry = run_command(["make", "--no-print-directory", "-n", "-o", ".venv/.installed", "-o", ".venv/.installed-eval",
                       "-o", ".venv/.installed-real",
                       "demo-real"], launcher="real")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines()[-2:] == [".venv/bin/python scripts/show_run.py outputs/demo-real",
                                            "cat outputs/demo-real/samples.md"]  # show_run prints base -> tuned


def _evaluate_script():
    spec = importlib.util.spec_from_file_location("evaluate_script", REPO_ROOT / "scripts" / "evaluate.py")
    evaluate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evaluate)
    return evaluate


def test_evaluate_py_loads_an_adapter_merged_onto_its_base(tmp_path, monkeypatch):
    import contextlib

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    evaluate = _evaluate_script()
    base_path = resolve_model_path("tiny:llama")
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_path),
                                LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    AutoTokenizer.from_pretrained(base_path).save_pretrained(tmp_path / "adapter")
    merged, _ = evaluate.load_model(str(tmp_path / "adapter"), None)
    assert type(merged).__name__ == "LlamaForCausalLM" and not any("lora" in n for n, _ in merged.named_parameters())
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():  # the merged weights compute what base + adapter compute (init_lora_weights=False: not 0)
        torch.testing.assert_close(merged(ids).logits, peft_model.eval()(ids).logits, atol=1e-5, rtol=1e-5)

    # --backend vllm (vLLM is not installed here: lm-eval's VLLM is replaced by what records its arguments): vLLM is
    # given a folder holding the merged model, which computes what base + adapter compute
    given = {}

    def recording_vllm(pretrained, **kwargs):
        given.update(kwargs, files=sorted(p.name for p in Path(pretrained).iterdir()))
        with torch.no_grad():
            given["logits"] = AutoModelForCausalLM.from_pretrained(pretrained)(ids).logits

    monkeypatch.setitem(sys.modules, "lm_eval.models.vllm_causallms", SimpleNamespace(VLLM=recording_vllm))
    args = SimpleNamespace(model=str(tmp_path / "adapter"), revision=None)
    with contextlib.ExitStack() as folders:
        evaluate.vllm_model(args, SimpleNamespace(seed=3), folders)
    assert {key: value for key, value in given.items() if key not in ("files", "logits")} == {
        "revision": None, "seed": 3, "batch_size": "auto"}
    assert "model.safetensors" in given["files"] and "adapter_config.json" not in given["files"]
    torch.testing.assert_close(given["logits"], merged(ids).logits.detach(), atol=1e-5, rtol=1e-5)


def test_evaluate_py_refuses_a_batch_or_answer_length_below_one_in_one_line(capsys):
    evaluate = _evaluate_script()
    lines = {("--batch_size", "0"): "error: argument --batch_size: 0 is not a whole number >= 1: give the requests "
                                    "scored together (default 8)",
             ("--max_gen_toks", "-4"): "error: argument --max_gen_toks: -4 is not a whole number >= 1: give the most "
                                       "tokens a generated answer may have",
             # these two were refused as "--tasks entry 'alpaca_answers': limit must be ...", not naming the option
             ("--limit", "0"): "error: argument --limit: 0 is not a whole number >= 1: give examples per task (the "
                               "first N); leave it out for all",
             ("--num_fewshot", "-1"): "error: argument --num_fewshot: -1 is not a whole number >= 0: give few-shot "
                                      "examples per prompt (0: none); leave it out for each task's own"}
    for option, line in lines.items():  # refused by argparse, before any model is looked for
        with pytest.raises(SystemExit) as refused:
            evaluate.main(["no/such-model", "--tasks", "alpaca_answers", *option])
        assert (refused.value.code, capsys.readouterr().err) == (2, line + "\n")


def test_evaluate_py_refuses_a_backend_it_does_not_offer_and_vllm_when_it_is_not_installed(capsys, monkeypatch):
    evaluate = _evaluate_script()
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    refusals = {
        "tgi": "error: --backend 'tgi' is not offered: use --backend hf (transformers, the default) or --backend vllm "
               "(lm-eval's vLLM model; pip install vllm)",
        "vllm": "error: --backend vllm needs vLLM, which is not installed: `.venv/bin/pip install vllm` (on a machine "
                "with GPUs), or score with --backend hf (transformers, the default)",
    }
    for backend, line in refusals.items():  # a model that does not exist: refused before anything loads it
        code = one_line_refusals(lambda: evaluate.main(["no/such-model", "--tasks", "alpaca_answers", "--backend",
                                                        backend]))
        assert (code, capsys.readouterr().err.strip().splitlines()) == (2, [line])


@pytest.mark.fsdp
def test_evaluate_py_on_two_processes_scores_what_one_process_scores(tmp_path):
    """lm-eval's data-parallel mode on gloo: each process scores half the requests, rank 0 gathers the same score and
    stderr one process computes; rank 0 alone reads and writes the cache, and every rank takes its hits."""
    base = resolve_model_path("tiny:llama")
    scoring = ["scripts/evaluate.py", base, "--tasks", "alpaca_answers", "--limit", "7", "--batch_size", "2",
               "--max_gen_toks", "4"]

    def launch(*args: str):
        return run_command([bin_path("accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
                            "--main_process_port", str(free_port()), *scoring, *args])

    one = run_command([bin_path("python"), *scoring, "--output", str(tmp_path / "one.json"), "--cache_dir",
                       str(tmp_path / "one-cache")])
    two = launch("--output", str(tmp_path / "two.json"), "--cache_dir", str(tmp_path / "two-cache"))
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    alone, shared = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("one", "two"))
    assert (alone["processes"], shared["processes"]) == (1, 2)
    assert shared["tasks"] == alone["tasks"]  # value, stderr and the 7 examples, exactly
    assert alone["tasks"]["alpaca_answers"]["samples"] == 7
    assert one.stdout.splitlines()[0] == "scored on 1 process (cpu)"
    assert two.stdout.splitlines()[0] == "scored on 2 processes (lm-eval's data-parallel mode, cpu, gloo)"
    assert two.stdout.count("scores: ") == 1  # rank 0 prints and writes
    assert len(list((tmp_path / "two-cache").glob("*.json"))) == 1
    # HFLM's warning about a model instance ("Please do not launch via accelerate") is untrue for both (our docs
    # launch it), "assuming single-process" true for one process only
    assert "assuming single-process call" in one.stderr and "is not of type `str`" not in one.stderr
    assert "assuming single-process call" not in two.stderr and "is not of type `str`" not in two.stderr

    # the 1-process run's cache, read on rank 0: both ranks take the hit (neither waits in a gather for the other)
    cached = launch("--output", str(tmp_path / "cached.json"), "--cache_dir", str(tmp_path / "one-cache"))
    assert cached.returncode == 0, cached.stderr[-3000:]
    assert json.loads((tmp_path / "cached.json").read_text())["tasks"] == alone["tasks"]
    assert cached.stderr.count("alpaca_answers: ") == 1 and "from the cache" in cached.stderr

    # a setting lm-eval's data-parallel mode cannot take: one line, exit 2 on every rank, before the model loads
    refused = launch("--backend", "vllm")
    assert rank_exit_codes(refused.stderr) == {0: 2, 1: 2}, refused.stderr[-3000:]
    assert [line for line in refused.stderr.splitlines() if line.startswith("error:")] == [
        "error: scripts/evaluate.py runs under a launch of 2 processes, but --backend vllm runs in one process (vLLM "
        "starts its own workers): run `.venv/bin/python scripts/evaluate.py ... --backend vllm`, or launch with "
        "--backend hf"]


def test_evaluate_py_names_its_own_option_when_it_refuses_a_task(capsys):
    evaluate = _evaluate_script()
    lines = {
        "gsm8k_locl": "error: --tasks: unknown task 'gsm8k_locl' -- not a task shipped in evals/tasks/ (alpaca_answers, "
                      "gsm8k_local, ifeval_local), not one of lm-eval's tasks (closest: gsm8k_local, gsm8k_llama, "
                      "gsm8k_cot), and not a .yaml task file",
        "alpaca_answers,alpaca_answers": "error: --tasks names a task twice (alpaca_answers): each task is scored once "
                                         "per model",
    }
    for tasks, line in lines.items():  # refused before the model (which does not exist) is looked for
        code = one_line_refusals(lambda: evaluate.main(["no/such-model", "--tasks", tasks]))
        assert (code, capsys.readouterr().err.strip().splitlines()) == (2, [line])


def test_a_model_that_is_neither_a_folder_nor_on_the_hub_is_one_refusal(tmp_path, monkeypatch):
    import transformers

    import sft_recipes.loading as loading

    evaluate = _evaluate_script()
    with pytest.raises(RecipeError) as refused:  # a path: never asked of the Hub
        evaluate.load_model(str(tmp_path / "no-folder" / "not-a-run"), None)
    assert str(refused.value) == (f"MODEL '{tmp_path / 'no-folder' / 'not-a-run'}' is not a folder here: pass a run's "
                                  "output_dir, a model folder, or a Hub id")

    def not_on_the_hub(name, **kwargs):  # transformers' words for a Hub id the Hub does not give
        raise OSError(f"{name} is not a local folder and is not a valid model identifier listed on "
                      "'https://huggingface.co/models'\nIf this is a private repository, make sure to pass a token")

    monkeypatch.setattr(loading, "hub_unreachable", lambda: None)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", not_on_the_hub)
    with pytest.raises(RecipeError) as refused:
        evaluate.load_model("acme/no-such-model", None)
    assert str(refused.value) == (
        "MODEL 'acme/no-such-model' is not a folder here and not a model the Hugging Face Hub gives (acme/no-such-model "
        "is not a local folder and is not a valid model identifier listed on 'https://huggingface.co/models'): pass a "
        "run's output_dir, a model folder, or a Hub id (with --revision; HF_TOKEN for a gated model)")


def test_a_mistyped_folder_in_a_folder_here_is_refused_at_once_where_the_hub_cannot_answer(tmp_path, monkeypatch):
    import transformers

    def hub(*args, **kwargs):
        raise AssertionError("asked the Hub (offline, huggingface_hub retries for ~30 s)")

    import sft_recipes.loading as loading

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", hub)
    monkeypatch.setattr(loading, "hub_unreachable", lambda: "huggingface.co does not resolve: no network")
    evaluate = _evaluate_script()
    (tmp_path / "outputs" / "demo").mkdir(parents=True)
    (tmp_path / "outputs" / "mine").mkdir()
    (tmp_path / "outputs" / "notes.txt").write_text("")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError) as refused:
        evaluate.load_model("outputs/dmeo", None)
    assert str(refused.value) == ("MODEL 'outputs/dmeo' is not a folder here (outputs is; it holds demo, mine), and the "
                                  "Hugging Face Hub cannot be asked for it (huggingface.co does not resolve: no "
                                  "network): pass a run's output_dir, a model folder, or a Hub id")
    with pytest.raises(AssertionError, match="asked the Hub"):  # an owner/name with no such folder here is a Hub id
        evaluate.load_model("meta-llama/Llama-3.1-8B", None)
    monkeypatch.setattr(loading, "hub_unreachable", lambda: None)
    with pytest.raises(AssertionError, match="asked the Hub"):  # and so is one beside a folder, where the Hub answers
        evaluate.load_model("outputs/dmeo", None)


def test_ifeval_local_is_lm_evals_ifeval_on_the_real_prompts_read_offline():
    class FunctionTags(yaml.SafeLoader):  # read the task file as text, without importing the checkers
        pass

    FunctionTags.add_constructor("!function", lambda loader, node: f"!function {loader.construct_scalar(node)}")
    ours = yaml.load((SHIPPED_TASKS_DIR / "ifeval_local.yaml").read_text(), Loader=FunctionTags)
    theirs = yaml.load((Path(importlib.util.find_spec("lm_eval").origin).parent / "tasks" / "ifeval" / "ifeval.yaml")
                       .read_text(), Loader=FunctionTags)
    assert {key: value for key, value in theirs.items() if key not in ours or ours[key] != value} == {
        "task": "ifeval", "dataset_path": "google/IFEval", "dataset_name": None,
        "process_results": "!function utils.process_results", "metric_list": theirs["metric_list"]}
    assert ours["process_results"] == "!function ifeval_checks.process_results"
    assert [{**m, "aggregation": m["aggregation"].replace("ifeval_checks.", "utils.")} for m in ours["metric_list"]] \
        == theirs["metric_list"]  # the same four metrics, aggregated by lm-eval's own function
    assert ours["dataset_kwargs"] == {"data_files": {"train": "data/realworld/eval/google__IFEval.input_data.jsonl"}}
    rows = [json.loads(line) for line in (REALWORLD / "eval" / "google__IFEval.input_data.jsonl").read_text().splitlines()]
    assert len(rows) == 541 and all(set(row) == {"key", "prompt", "instruction_id_list", "kwargs"} for row in rows)
    assert rows[0]["instruction_id_list"] == ["punctuation:no_comma", "detectable_format:number_highlighted_sections",
                                              "length_constraints:number_words"]
    checks = (SHIPPED_TASKS_DIR / "ifeval_checks.py").read_text()
    assert "from lm_eval.tasks.ifeval.utils import agg_inst_level_acc, process_results" in checks
