"""End to end on the CPU test bed: real `accelerate launch`, 2 processes, FSDP2 over gloo.

One module-scoped set of runs feeds every test: a 2-process run (with MLflow and a fake HF token),
the same global batch in one process, a resume from its mid-run checkpoint, and a simulated
2-node launch through the same script `make llama-multinode` uses.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sqlite3
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import (
    REPO_ROOT, TINY_LLAMA_RECIPE, assert_resume_reproduces, bin_path, free_port, launch_sft, read_summary, run_command,
)

pytestmark = pytest.mark.fsdp

STEPS, SAVE_EVERY = 8, 4
COMMON = ["--max_steps", str(STEPS), "--save_steps", str(SAVE_EVERY)]
FAKE_TOKEN = "hf_SECRETtestTOKEN0123456789abcdef"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    store = root / "mlflow.db"
    env = {"HF_TOKEN": FAKE_TOKEN, "MLFLOW_TRACKING_URI": f"sqlite:///{store}"}
    # make demo's command through the real `accelerate launch` (docs/testing.md: which tests use which launcher)
    two = launch_sft(TINY_LLAMA_RECIPE, *COMMON, "--output_dir", str(root / "two"), env=env, launcher="real")

    # Same global batch (4 x 2 accumulation x 2 ranks = 16) in one plain process.
    single_cmd = [bin_path("python"), "scripts/sft.py", str(TINY_LLAMA_RECIPE), *COMMON,
                  "--gradient_accumulation_steps", "4", "--output_dir", str(root / "one"), "--report_to", "none"]
    one = run_command(single_cmd)
    assert one.returncode == 0, one.stderr[-4000:]

    # Preempted after checkpoint-4: resume in place (resume_from_checkpoint: auto), logging into the
    # same MLflow run as a managed platform does on retry (MLFLOW_RUN_ID).
    shutil.copytree(root / "two", root / "full")
    shutil.rmtree(root / "two" / f"checkpoint-{STEPS}")
    run_id = read_summary(root / "full")["mlflow_run_id"]
    resumed = launch_sft(TINY_LLAMA_RECIPE, *COMMON, "--output_dir", str(root / "two"), env={**env, "MLFLOW_RUN_ID": run_id})

    # The same command again on the finished run: nothing left to train.
    before = {path.relative_to(root): path.stat().st_mtime_ns for path in (root / "full").rglob("*")}
    again = launch_sft(TINY_LLAMA_RECIPE, *COMMON, "--output_dir", str(root / "full"), "--report_to", "none",
                       check=False)
    after = {path.relative_to(root): path.stat().st_mtime_ns for path in (root / "full").rglob("*")}
    # A read-only audit of the finished run's rows as chat, at another global batch (1 process x 2 accumulation =
    # 8 sequences): neither the other format nor the other batch may matter, nothing is resumed.
    audit = run_command([bin_path("python"), "scripts/sft.py", str(TINY_LLAMA_RECIPE), "--audit-data", "1",
                         "--dataset_format", "alpaca_chat", "--output_dir", str(root / "full")])
    return {"root": root, "store": store, "full": two, "one": one, "resumed": resumed, "again": again,
            "untouched": before == after, "audit": audit}


def test_rerunning_a_finished_run_trains_nothing_and_writes_nothing(runs):
    again = runs["again"]
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"checkpoint-{STEPS} has already trained {STEPS} step(s), reaching max_steps {STEPS}: nothing to train" \
        in again.stdout
    assert runs["untouched"] and not (runs["root"] / "full" / f"checkpoint-{STEPS + 1}").exists()


def test_audit_after_a_run_reads_the_data_without_choosing_a_checkpoint(runs):
    audit = runs["audit"]
    assert audit.returncode == 0, audit.stderr[-3000:]
    assert "resume_from_checkpoint=auto" not in audit.stderr and "=== example 0" in audit.stdout


def test_console_is_one_line_per_step_and_train_log_keeps_it(runs):
    console = runs["full"].stdout + runs["full"].stderr
    for step in range(1, STEPS + 1):
        assert re.search(rf"^step {step}/{STEPS} \| loss \d+\.\d{{4}} \| lr \d\.\d\de-\d\d \| grad norm .* \| [\d,]+ "
                         rf"tokens/s/device \| peak \d+\.\d\d GiB \| ETA \d+:\d\d:\d\d$", console, re.M), step
    assert "{'loss'" not in console
    log = (runs["root"] / "full" / "train.log").read_text()
    assert log.startswith("== ") and f"[train] {STEPS} steps in" in log
    assert re.findall(rf"^step \d+/{STEPS} \| loss .*$", log, re.M) == re.findall(rf"^step \d+/{STEPS} \| loss .*$", console, re.M)
    # rank 1 draws no bars: the console's final "Tokenizing" frames are rank 0's, the ones in its log
    frames = re.findall(r"Tokenizing [^:]*: 100%[^\r\n]*", console)
    assert frames and frames == re.findall(r"Tokenizing [^:]*: 100%[^\r\n]*", log)
    # a resume appends to the same log: two runs, two headers
    assert (runs["root"] / "two" / "train.log").read_text().count("\n== ") + 1 == 2


def test_make_show_and_the_chat_command_it_prints_run_as_printed(runs):
    from test_readme_commands import fresh_shell_env

    # -o: this venv exists; a fresh checkout's timestamps must not make make rebuild it
    shown = run_command(["make", "-s", "-o", ".venv/.installed", "show", f"OUT={runs['root'] / 'full'}"],
                        env=fresh_shell_env())
    assert shown.returncode == 0, shown.stderr[-3000:]
    once = re.search(r"one answer: (make chat OUT=\S+ ARGS='--prompt \"Hi\"')", shown.stdout)
    assert once and "python scripts/" not in shown.stdout.replace(".venv/bin/python scripts/", ""), shown.stdout
    words = shlex.split(once.group(1))
    chat = run_command([words[0], "-s", "-o", ".venv/.installed", *words[1:]], env=fresh_shell_env())
    assert chat.returncode == 0, chat.stderr[-3000:]


def test_two_process_run_is_fsdp2(runs):
    assert read_summary(runs["root"] / "full")["distributed"] == "FSDP2 over 2 process(es) on cpu"
    assert read_summary(runs["root"] / "one")["distributed"] == "NO over 1 process(es) on cpu"


def test_fsdp2_losses_equal_single_process_with_same_global_batch(runs):
    two = read_summary(runs["root"] / "full")["losses"]
    one = read_summary(runs["root"] / "one")["losses"]
    assert list(two) == [str(s) for s in range(1, STEPS + 1)]
    for step in two:
        assert two[step] == pytest.approx(one[step], abs=1e-4), step
    assert two[str(STEPS)] < two["1"] - 0.5, "the tiny model must learn"


def probe_logits(path, input_ids):
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def test_export_is_a_plain_checkpoint_with_the_trained_logits(runs):
    two, one = runs["root"] / "full", runs["root"] / "one"
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (two / name).is_file(), name
    assert read_summary(two)["export_max_logit_diff"] <= 1e-4  # in-run check against the sharded model
    probe = torch.tensor([[0, 20, 31, 47, 5, 99, 120, 7, 64, 3]])
    trained = probe_logits(two, probe)
    # Independent check: the single-process run trained the same model, so its export must agree.
    assert torch.allclose(trained, probe_logits(one, probe), atol=1e-4)


def test_resume_from_mid_run_checkpoint_reproduces_later_losses(runs):
    assert_resume_reproduces(runs["root"] / "full", runs["root"] / "two", SAVE_EVERY, atol=1e-4)


def test_simulated_two_node_launch(runs, tmp_path):
    """Two `scripts/launch_multinode.sh` invocations, NODE_RANK 0 and 1, one process each."""
    port = str(free_port())
    procs = []
    for node_rank in ("0", "1"):
        env = {"NUM_NODES": "2", "NODE_RANK": node_rank, "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "PATH": f"{REPO_ROOT / '.venv' / 'bin'}:{bin_path('')}:/usr/bin:/bin"}
        cmd = ["scripts/launch_multinode.sh", "accelerate_configs/fsdp2_cpu.yaml", str(TINY_LLAMA_RECIPE), *COMMON,
               "--output_dir", str(tmp_path / "multinode"), "--report_to", "none"]
        procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env={**__import__("os").environ, **env},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "[launch] node 1/2: 1 processes here, world size 2, rendezvous 127.0.0.1" in outputs[1]
    summary = read_summary(tmp_path / "multinode")
    assert summary["distributed"] == "FSDP2 over 2 process(es) on cpu"
    single_node = read_summary(runs["root"] / "full")["losses"]
    for step, loss in summary["losses"].items():
        assert loss == pytest.approx(single_node[step], abs=1e-4)


def test_mlflow_has_one_run_with_params_and_a_loss_per_step(runs):
    db = sqlite3.connect(runs["store"])
    experiments = db.execute("select experiment_id from experiments where name = 'sft-recipes-tiny-llama8b'").fetchall()
    assert len(experiments) == 1
    run_ids = [r[0] for r in db.execute("select run_uuid from runs where experiment_id = ?", experiments[0])]
    assert run_ids == [read_summary(runs["root"] / "full")["mlflow_run_id"]]
    assert read_summary(runs["root"] / "two")["mlflow_run_id"] == run_ids[0]  # MLFLOW_RUN_ID honoured on resume
    params = dict(db.execute("select key, value from params where run_uuid = ?", run_ids))
    assert float(params["learning_rate"]) == 3e-3 and params["recipe.model_name_or_path"] == "tiny:llama"
    loss_steps = [r[0] for r in db.execute("select step from metrics where run_uuid = ? and key = 'loss' order by step", run_ids)]
    resumed_steps = list(range(SAVE_EVERY + 1, STEPS + 1))
    assert loss_steps == sorted(list(range(1, STEPS + 1)) + resumed_steps)


def test_run_writes_curves_samples_and_card_and_logs_them_to_mlflow(runs):
    from huggingface_hub import ModelCard
    from mlflow import MlflowClient

    full, resumed = runs["root"] / "full", runs["root"] / "two"
    assert (full / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    card = ModelCard.load(full / "README.md")
    assert card.data.base_model == "tiny:llama" and f"| optimizer steps | {STEPS} |" in card.text
    assert "\n# tiny:llama SFT (" in card.text and "meaningless by design" in card.text
    # Tokens seen: unpadded, over both ranks; the same in one process at the same global batch, and carried
    # through a resume by the checkpoint's trainer state.
    seen = {name: json.loads((runs["root"] / name / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())[
        "num_input_tokens_seen"] for name in ("full", "one", "two")}
    assert seen["full"] == seen["one"] == seen["two"] > STEPS * 16  # 16 rows per step, each more than one token
    assert f"| tokens seen | {seen['full']:,} (input tokens of the steps run, padding left out) |" in card.text
    for name in ("full", "two"):  # TRL's own num_tokens started again from 0 on the resume
        history = json.loads((runs["root"] / name / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())["log_history"]
        assert [entry for entry in history if "loss" in entry][-1]["num_tokens"] == seen[name], name
    samples = (full / "samples.md").read_text()
    assert samples.count("**Before training (base model)**") == 3 and "(not generated)" not in samples
    # Asked as the alpaca rows were trained (before: the chat template, and every answer began "### Response:")
    assert samples.startswith("# Sample generations (greedy, alpaca prompt `### Instruction: ... ### Response:`)")
    after = [part.split("\n\n")[0] for part in samples.split("**After training (reloaded export)**\n\n")[1:]]
    assert "meaningless by design" in samples and len(after) == 3
    assert not any(answer.startswith("> ### Response") for answer in after), after
    # The resumed run kept the base model's answers from its first start.
    before = lambda text: [part.split("**After")[0] for part in text.split("**Before training (base model)**")[1:]]
    assert before((resumed / "samples.md").read_text()) == before(samples)
    client = MlflowClient(f"sqlite:///{runs['store']}")
    logged = {a.path for a in client.list_artifacts(read_summary(full)["mlflow_run_id"])}
    assert {"training_curves.png", "samples.md", "README.md", "data_report.json", "run_summary.json"} <= logged


def test_hf_token_never_leaks(runs):
    leaks = [f"{run} {name}" for run in ("full", "resumed") for name in ("stdout", "stderr")
             if FAKE_TOKEN in getattr(runs[run], name)]
    if FAKE_TOKEN.encode() in runs["store"].read_bytes():
        leaks.append(str(runs["store"]))
    for path in runs["root"].rglob("*"):
        if path.is_file() and FAKE_TOKEN.encode() in path.read_bytes():
            leaks.append(str(path))
    assert leaks == []


def test_plain_torchrun_with_fsdp_in_the_recipe(runs, tmp_path):
    """No accelerate launcher: torchrun + the recipe's own `fsdp`/`fsdp_config` give the same FSDP2 run."""
    cmd = [bin_path("torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), "scripts/sft.py",
           str(TINY_LLAMA_RECIPE), "--max_steps", "3", "--output_dir", str(tmp_path / "torchrun"), "--report_to", "none",
           "--fsdp", "full_shard auto_wrap", "--fsdp_config", '{"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}']
    result = run_command(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_summary(tmp_path / "torchrun")
    assert summary["distributed"] == "FSDP2 over 2 process(es) on cpu"
    full = read_summary(runs["root"] / "full")["losses"]
    for step, loss in summary["losses"].items():
        assert loss == pytest.approx(full[step], abs=1e-4), step
