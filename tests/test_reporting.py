"""End-of-run reporting: curves picture, MLflow artifacts, model card, Hub push (up to the upload call)."""

from __future__ import annotations

import json
from pathlib import Path
import struct

import pytest
import yaml
from huggingface_hub import ModelCard

from conftest import (
    REPO_ROOT, TINY_LLAMA_RECIPE, a_proxy_that_closes_every_connection, an_http_server, launch_sft, read_summary,
)
from fault_helpers import rank_exit_codes
from sft_recipes.errors import RecipeError
from sft_recipes.reporting.card import CardFacts, base_license, data_sources_from, last_logged, write_model_card
from sft_recipes.reporting.curves import (
    CURVES_FILE, TrainingCurvesCallback, draw_training_curves, series, write_training_curves,
)
from sft_recipes.reporting.export_check import ExportCheck
from sft_recipes.reporting.hub import (
    HubPush, files_to_upload, push_export, push_or_refusal, take_over_hub_push, upload_command,
)
from sft_recipes.reporting.mlflow_artifacts import log_output_dir_artifacts

LOG_HISTORY = [
    {"step": 1, "loss": 2.5, "learning_rate": 1e-3, "tokens_per_second_per_device": 900.0},
    {"step": 2, "loss": 2.25, "learning_rate": 1e-3, "tokens_per_second_per_device": 1100.0},
    {"step": 2, "eval_loss": 2.4},
    {"step": 3, "loss": 2.0, "learning_rate": 5e-4, "tokens_per_second_per_device": 1000.0},
    {"step": 3, "train_runtime": 4.2},
]


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


# ── Curves ────────────────────────────────────────────────────────────────────────────────────


def test_series_reads_each_quantity_against_its_step():
    assert series(LOG_HISTORY, "loss") == ([1, 2, 3], [2.5, 2.25, 2.0])
    assert series(LOG_HISTORY, "eval_loss") == ([2], [2.4])
    assert series(LOG_HISTORY, "tokens_per_second_per_device") == ([1, 2, 3], [900.0, 1100.0, 1000.0])
    assert series(LOG_HISTORY, "grad_norm") == ([], [])


def test_curves_picture_is_a_png_of_three_panels(tmp_path):
    path = write_training_curves(LOG_HISTORY, tmp_path / "sub" / CURVES_FILE)
    assert png_size(path) == (800, 700)  # figsize 8 x 7 inches at 100 dpi


def test_the_learning_rate_panel_is_the_smallest_and_says_when_it_is_constant():
    import matplotlib.pyplot as plt

    figure = draw_training_curves([{**entry, "learning_rate": 2e-5} for entry in LOG_HISTORY if "loss" in entry])
    loss, learning_rate, throughput = (axis.get_position().height for axis in figure.axes)
    titles = [axis.get_title() for axis in figure.axes]
    plt.close(figure)
    assert learning_rate == pytest.approx(loss / 3, rel=0.05) and learning_rate == pytest.approx(throughput / 2, rel=0.05)
    assert titles == ["loss", "learning rate (constant 2.00e-05)", "tokens/s per device"]


def test_a_run_that_stopped_early_shows_where_and_the_steps_it_did_not_run():
    import matplotlib.pyplot as plt

    figure = draw_training_curves(LOG_HISTORY, max_steps=6)  # its last step is 3
    lines = [[line.get_xdata()[0] for line in axis.get_lines() if line.get_linestyle() == "--"] for axis in figure.axes]
    right_edges = [axis.get_xlim()[1] for axis in figure.axes]
    title = figure._suptitle.get_text()
    plt.close(figure)
    assert (title, lines, right_edges) == ("stopped at step 3 of 6", [[3], [3], [3]], [6, 6, 6])
    finished = draw_training_curves(LOG_HISTORY, max_steps=3)
    assert finished._suptitle is None and all(len(axis.get_lines()) <= 2 for axis in finished.axes)
    plt.close(finished)


def test_curves_of_a_run_resumed_near_its_end_tick_whole_steps():
    import matplotlib.pyplot as plt

    figure = draw_training_curves([{"step": 5, "loss": 0.68, "learning_rate": 1e-3}])  # resumed at 4, one step left
    figure.canvas.draw()
    ticks = figure.axes[-1].get_xticks()
    plt.close(figure)
    assert len(ticks) and all(float(tick).is_integer() for tick in ticks), ticks


class State:
    def __init__(self, is_main: bool):
        self.is_world_process_zero = is_main
        self.log_history = list(LOG_HISTORY)
        self.max_steps = 3


class Args:
    def __init__(self, output_dir, report_to=()):
        self.output_dir = str(output_dir)
        self.report_to = list(report_to)


def test_curves_callback_draws_on_rank_0_only(tmp_path):
    callback = TrainingCurvesCallback()
    callback.on_save(Args(tmp_path / "rank1"), State(is_main=False), None)
    assert not (tmp_path / "rank1").exists()
    callback.on_train_end(Args(tmp_path / "rank0"), State(is_main=True), None)
    assert png_size(tmp_path / "rank0" / CURVES_FILE) == (800, 700)


def test_the_final_eval_after_train_end_is_drawn(tmp_path):
    """Training.run evaluates the last weights after train end: the picture is drawn again with that point."""
    callback, state = TrainingCurvesCallback(), State(is_main=True)
    callback.on_evaluate(Args(tmp_path / "during"), state, None)  # an eval during training: drawn at the next save
    assert not (tmp_path / "during").exists()
    callback.on_train_end(Args(tmp_path), state, None)
    before = (tmp_path / CURVES_FILE).read_bytes()
    state.log_history.append({"step": 3, "eval_loss": 2.1})
    callback.on_evaluate(Args(tmp_path), state, None)
    assert (tmp_path / CURVES_FILE).read_bytes() != before


def test_end_of_run_files_are_logged_to_the_mlflow_run(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlruns.db'}")
    client = MlflowClient()
    run_id = client.create_run(client.create_experiment("reporting", artifact_location=str(tmp_path / "art"))).info.run_id
    out = tmp_path / "out"
    write_training_curves(LOG_HISTORY, out / CURVES_FILE)
    (out / "run_summary.json").write_text("{}")
    (out / "data_report.json").write_text("{}")
    logged = log_output_dir_artifacts(run_id, out)
    assert [p.name for p in logged] == [CURVES_FILE, "data_report.json", "run_summary.json"]  # no plan.json there
    assert sorted(a.path for a in client.list_artifacts(run_id)) == sorted(p.name for p in logged)
    assert log_output_dir_artifacts(None, out) == []


# ── Model card ────────────────────────────────────────────────────────────────────────────────


def card_facts(**changes) -> CardFacts:
    values = {"model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "learning_rate": 1e-4,
              "output_dir": "outputs/x"}
    facts = dict(
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct", base_revision="abc123",
        data_sources=data_sources_from([{"name": "tatsu-lab/alpaca", "revision": "r1", "weight": 3},
                                        {"name": "data/samples/ultrachat.jsonl", "weight": 1}]),
        recipe_values=values, recipe_path="recipes/smollm2-135m.yaml", export_kind="full",
        export_check=ExportCheck("passed", 2e-6), hardware="2 x CPU (gloo)", world_size=2, steps=8,
        tokens_seen=12345, final_train_loss=last_logged(LOG_HISTORY, "loss"),
        final_eval_loss=last_logged(LOG_HISTORY, "eval_loss"), license="apache-2.0",
    )
    facts.update(changes)
    return CardFacts(**facts)


def test_card_parses_back_and_names_the_base_model(tmp_path):
    path = write_model_card(card_facts(), tmp_path)
    card = ModelCard.load(path)
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert card.data.datasets == ["tatsu-lab/alpaca"]  # the local file is in the body, not in the Hub metadata
    assert card.data.library_name == "transformers" and card.data.license == "apache-2.0"
    assert "| tatsu-lab/alpaca | r1 | train | 75.0% |" in card.text
    assert "| data/samples/ultrachat.jsonl | unpinned | train | 25.0% |" in card.text
    assert "| final train loss | 2.0000 |" in card.text and "| final eval loss | 2.4000 |" in card.text
    assert "| tokens seen | 12,345 (input tokens of the steps run, padding left out) |" in card.text
    assert "max abs difference 2e-06" in card.text
    assert "\n# SmolLM2-135M-Instruct SFT (recipes/smollm2-135m.yaml)\n" in card.text and "**Note:**" not in card.text
    recipe = yaml.safe_load(card.text.split("```yaml\n")[1].split("```")[0])
    assert recipe == {"model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "learning_rate": 1e-4,
                      "output_dir": "outputs/x"}


def test_a_tiny_twins_card_is_titled_by_the_model_run_and_says_it_is_a_random_stand_in(tmp_path):
    from sft_recipes.reporting.samples import random_stand_in

    facts = card_facts(base_model="tiny:llama", recipe_path=str(Path.cwd() / "recipes" / "tiny" / "llama8b.yaml"),
                       stand_in_note=random_stand_in("tiny:llama"))
    text = ModelCard.load(write_model_card(facts, tmp_path)).text
    assert "\n# tiny:llama SFT (recipes/tiny/llama8b.yaml)\n" in text and "# llama8b\n" not in text
    assert "> **Note:** tiny:llama is a tiny randomly initialised stand-in: its answers are meaningless" in text
    assert "\n# my-org/my-model\n" in ModelCard.load(write_model_card(
        card_facts(hub_model_id="my-org/my-model"), tmp_path)).text


def test_adapter_card_says_how_to_load_base_plus_adapter(tmp_path):
    card = ModelCard.load(write_model_card(card_facts(export_kind="adapter", hub_model_id="me/x"), tmp_path))
    assert card.data.library_name == "peft" and "lora" in card.data.tags
    assert "PeftModel.from_pretrained(base, 'me/x')" in card.text
    assert "from_pretrained('HuggingFaceTB/SmolLM2-135M-Instruct', revision='abc123')" in card.text


def test_card_never_shows_a_secret(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value_123")
    facts = card_facts(recipe_values={"dataset_name": "https://user:hf_secret_value_123@host/data"})
    text = write_model_card(facts, tmp_path).read_text()
    assert "hf_secret_value_123" not in text and "dataset_name: <redacted>" in text


def test_single_source_share_and_base_licence_from_its_card(tmp_path):
    (tmp_path / "README.md").write_text("---\nlicense: llama3.1\n---\n# base\n")
    assert base_license(tmp_path) == "llama3.1"
    (tmp_path / "README.md").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert base_license(tmp_path) is None
    sources = data_sources_from([{"dataset_name": "tatsu-lab/alpaca"}])
    assert "| tatsu-lab/alpaca | unpinned | train | 100% |" in write_model_card(
        card_facts(data_sources=sources), tmp_path).read_text()
    with pytest.raises(ValueError, match="names no dataset"):
        data_sources_from([{"weight": 1}])


# ── Hub push (everything up to the upload call) ───────────────────────────────────────────────


class RecordingApi:
    def __init__(self):
        self.calls = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))
        return "commit-info"


@pytest.fixture
def export_dir(tmp_path):
    out = tmp_path / "out"
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "run_summary.json", CURVES_FILE):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("x")
    (out / "checkpoint-4").mkdir()
    (out / "checkpoint-4" / "model.safetensors").write_text("x")
    write_model_card(card_facts(), out)
    return out


def test_push_uploads_exactly_the_export_files_privately(export_dir, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_abc")
    api = RecordingApi()
    assert push_export(HubPush("me/model", private=True), export_dir, ExportCheck("passed", 0.0), api=api) == "commit-info"
    (_, repo, create_kwargs), (_, upload_kwargs) = api.calls
    assert repo == "me/model" and create_kwargs == {"private": True, "exist_ok": True, "token": "hf_abc"}
    assert upload_kwargs["folder_path"] == str(export_dir) and upload_kwargs["token"] == "hf_abc"
    assert upload_kwargs["allow_patterns"] == [
        "README.md", "config.json", "generation_config.json", "model.safetensors", "run_summary.json",
        "tokenizer.json", "tokenizer_config.json", CURVES_FILE]  # checkpoint-4/ stays home
    assert files_to_upload(export_dir) == upload_kwargs["allow_patterns"]


@pytest.mark.parametrize("check, reason", [(ExportCheck("failed", 3.0, "max |logit diff| 3 > 1e-4"), "Fix the export"),
                                           (ExportCheck("skipped"), "Set verify_export: true")])
def test_no_push_without_a_passed_export_check(export_dir, monkeypatch, check, reason):
    monkeypatch.setenv("HF_TOKEN", "hf_abc")
    api = RecordingApi()
    with pytest.raises(RuntimeError, match=f"Not pushing .* to me/model: the export check .*{reason}"):
        push_export(HubPush("me/model", private=True), export_dir, check, api=api)
    assert api.calls == []


def test_the_upload_command_publishes_what_the_push_does(export_dir):
    """The `hf upload` an `error:` line hands over: the export's top-level files, not its checkpoint-4/."""
    import shlex

    from huggingface_hub.utils import filter_repo_objects

    command = shlex.split(upload_command(HubPush("me/model", private=True), export_dir))
    assert command[:4] == [".venv/bin/hf", "upload", "me/model", str(export_dir)] and command[-1] == "--private"
    excluded = command[command.index("--exclude") + 1]
    every_file = [str(path.relative_to(export_dir)) for path in export_dir.rglob("*") if path.is_file()]
    assert "checkpoint-4/model.safetensors" in every_file
    assert sorted(filter_repo_objects(every_file, ignore_patterns=[excluded])) == files_to_upload(export_dir)
    assert "--private" not in upload_command(HubPush("me/model", private=False), export_dir)


class FailingApi(RecordingApi):
    def __init__(self, error):
        super().__init__()
        self.error = error

    def upload_folder(self, **kwargs):
        raise self.error


def test_a_push_the_hub_fails_is_a_refusal_that_keeps_the_export_and_names_the_upload(export_dir, monkeypatch):
    import httpx2
    from huggingface_hub.errors import OfflineModeIsEnabled

    monkeypatch.setenv("HF_TOKEN", "hf_abc")
    push, passed = HubPush("me/model", private=True), ExportCheck("passed", 0.0)
    kept = (f"The export is kept there, checked, with its card and run_summary.json: upload it once the Hub answers, "
            f'with `.venv/bin/hf upload me/model {export_dir} --exclude "*/*" --private`')
    for error, reason in ((httpx2.ConnectError("[Errno 111] Connection refused\nmore"),
                           "ConnectError: [Errno 111] Connection refused"),
                          (OfflineModeIsEnabled(), "OfflineModeIsEnabled")):
        assert push_or_refusal(push, export_dir, passed, api=FailingApi(error)) == (
            f"the push of {export_dir} to me/model on the Hugging Face Hub failed ({reason}). {kept}")
    assert push_or_refusal(push, export_dir, passed, api=RecordingApi()) is None
    with pytest.raises(RuntimeError, match="Not pushing"):  # an unchecked export is our refusal to push, not the Hub's
        push_or_refusal(push, export_dir, ExportCheck("skipped"), api=RecordingApi())


@pytest.mark.fsdp
def test_a_push_the_hub_fails_after_training_is_one_line_on_every_rank_and_the_export_stays(tmp_path):
    out = tmp_path / "out"
    # The Hub behind a proxy that closes every connection: not refused at start (the proxy connects, not this
    # machine), the push after training fails at once.
    with a_proxy_that_closes_every_connection() as proxy:
        result = launch_sft(TINY_LLAMA_RECIPE, "--max_steps", "2", "--save_steps", "1000", "--sample_prompts", "[]",
                            "--report_to", "none", "--output_dir", str(out), "--push_to_hub", "true",
                            "--hub_model_id", "me/tiny-push", env={"HF_TOKEN": "hf_push_test", "HTTPS_PROXY": proxy},
                            check=False)
    assert rank_exit_codes(result.stderr) == {0: 2, 1: 2}, result.stderr[-3000:]  # every rank refused
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: the push of {out} to me/tiny-push on the Hugging Face "
                                                     "Hub failed ("), result.stderr[-3000:]
    assert errors[0].endswith(f'with `.venv/bin/hf upload me/tiny-push {out} --exclude "*/*" --private`')
    # no traceback through the package (under SFT_TESTS_LAUNCHER=real, accelerate's own ChildFailedError follows)
    assert f'File "{REPO_ROOT / "src"}' not in result.stderr, result.stderr[-3000:]
    assert [line for line in result.stdout.splitlines() if line.startswith("[train] 2 steps in ")]  # the closing line
    assert read_summary(out)["steps"] == 2 and (out / "model.safetensors").is_file() and (out / "README.md").is_file()


class HubArgs:
    def __init__(self, push_to_hub=True, hub_model_id="me/model", hub_private_repo=None):
        self.push_to_hub, self.hub_model_id, self.hub_private_repo = push_to_hub, hub_model_id, hub_private_repo


@pytest.fixture
def hub_answers(monkeypatch):
    import sft_recipes.loading as loading

    monkeypatch.setattr(loading, "hub_unreachable", lambda: None)


def test_take_over_switches_the_trainer_push_off_and_defaults_to_private(monkeypatch, hub_answers):
    monkeypatch.setenv("HF_TOKEN", "hf_abc")
    args = HubArgs()
    assert take_over_hub_push(args) == HubPush("me/model", private=True) and args.push_to_hub is False
    assert take_over_hub_push(HubArgs(hub_private_repo=False)) == HubPush("me/model", private=False)
    assert take_over_hub_push(HubArgs(push_to_hub=False)) is None


def test_a_push_where_the_hub_cannot_be_asked_is_refused_before_training(monkeypatch):
    import sft_recipes.loading as loading

    monkeypatch.setenv("HF_TOKEN", "hf_abc")
    monkeypatch.setattr(loading, "hub_unreachable", lambda: "huggingface.co does not resolve: no network")
    with pytest.raises(RecipeError) as refused:
        take_over_hub_push(HubArgs())
    assert str(refused.value) == (
        "push_to_hub: true, but the Hugging Face Hub cannot be asked from here (huggingface.co does not resolve: no "
        "network): the push after training would fail. Set push_to_hub: false and upload the export later "
        '(`.venv/bin/hf upload me/model OUTPUT_DIR --exclude "*/*" --private`), or run where the Hub answers.')
    assert take_over_hub_push(HubArgs(push_to_hub=False)) is None  # no push, nothing to refuse


WRITE_TOKEN = {"type": "user", "name": "me", "auth": {"type": "access_token",
                                                      "accessToken": {"displayName": "ci-push", "role": "write"}}}
READ_TOKEN = {"type": "user", "name": "me", "auth": {"type": "access_token",
                                                     "accessToken": {"displayName": "laptop", "role": "read"}}}


@pytest.mark.parametrize(("status", "answer", "refusal"), [
    (200, WRITE_TOKEN, None),
    (200, READ_TOKEN, "push_to_hub: true, but the token in HF_TOKEN (laptop) is read-only: the Hub would refuse the push "
                      "of me/model after training. Set HF_TOKEN to a write token, or a fine-grained one that may write "
                      "to me."),
    (401, {"error": "Invalid credentials in Authorization header"},
     "push_to_hub: true, but the Hugging Face Hub rejects the token in HF_TOKEN (401, invalid or revoked): the push of "
     "me/model after training would fail. Set HF_TOKEN to a token with write access "
     "(https://huggingface.co/settings/tokens)."),
    (429, {"error": "rate limited"}, None),  # whoami is rate-limited: the push asks again
], ids=["write", "read-only", "rejected", "busy"])
def test_the_launch_precheck_asks_the_hub_whether_the_token_can_push(status, answer, refusal, monkeypatch):
    from huggingface_hub import constants

    from sft_recipes.preflight_launch import recipe_refusal

    monkeypatch.setenv("HF_TOKEN", "hf_abc")
    with an_http_server(status, answer) as (hub, asked):
        monkeypatch.setattr(constants, "ENDPOINT", hub)  # HF_ENDPOINT
        assert recipe_refusal("accelerate_configs/fsdp2_cpu.yaml", str(TINY_LLAMA_RECIPE),
                              ["--push_to_hub", "true", "--hub_model_id", "me/model"], None, False) == refusal
        # huggingface_hub also asks once per process for its agent list (huggingface_hub#4904)
        whoami = [path for path in asked if path != "/api/agent-harnesses"]
        assert whoami == ["/api/whoami-v2"]
        if answer is WRITE_TOKEN:
            asked.clear()
            assert recipe_refusal("accelerate_configs/fsdp2_cpu.yaml", str(TINY_LLAMA_RECIPE), [], None, False) is None
            assert asked == []  # no push: the Hub is not asked


def test_missing_token_or_id_is_named(monkeypatch, tmp_path, export_dir, hub_answers):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_TOKEN_PATH", raising=False)
    with pytest.raises(ValueError, match="needs a Hugging Face token with write access in the HF_TOKEN"):
        take_over_hub_push(HubArgs())
    with pytest.raises(ValueError, match="needs a Hugging Face token"):
        push_export(HubPush("me/model", True), export_dir, ExportCheck("passed", 0.0), api=RecordingApi())
    token_file = tmp_path / "token"
    token_file.write_text("hf_from_file\n")
    monkeypatch.setenv("HF_TOKEN_PATH", str(token_file))
    with pytest.raises(ValueError, match="push_to_hub: true needs hub_model_id"):
        take_over_hub_push(HubArgs(hub_model_id=None))
    api = RecordingApi()
    push_export(HubPush("me/model", True), export_dir, ExportCheck("passed", 0.0), api=api)
    assert api.calls[1][1]["token"] == "hf_from_file"
