"""A failed export check leaves nothing in output_dir that could be taken for a result (single process)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sft_recipes import export
from sft_recipes.export import ExportCheckError, export_run
from sft_recipes.reporting.export_check import ExportCheck
from sft_recipes.tiny import ensure_tiny

EXPORTED = {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}


class OneProcessAccelerator:
    """What the export touches of an Accelerator, for one process without a launcher."""

    is_main_process = True
    device = torch.device("cpu")

    def get_state_dict(self, model):
        return model.state_dict()

    def unwrap_model(self, model):
        return model

    def wait_for_everyone(self):
        pass


@pytest.fixture
def trainer():
    path = ensure_tiny("llama")
    return SimpleNamespace(accelerator=OneProcessAccelerator(), model=AutoModelForCausalLM.from_pretrained(path),
                           processing_class=AutoTokenizer.from_pretrained(path),
                           training_data=[{"input_ids": [5, 17, 42, 9, 3, 28]}])


@pytest.fixture
def output_dir(tmp_path):
    (tmp_path / "checkpoint-2").mkdir()  # the run's checkpoints and earlier files are not the export's
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("written before the export")
    return tmp_path


MODEL_ARGS = SimpleNamespace(use_peft=False, export_dtype="auto", verify_export=True)


def test_a_faithful_export_stays_in_place(trainer, output_dir):
    _, check = export_run(trainer, MODEL_ARGS, output_dir, load_base=None)
    assert check.status == "passed" and check.max_logit_diff <= 1e-4 and check.detail == ""
    assert EXPORTED <= {p.name for p in output_dir.iterdir()}
    assert not list(output_dir.glob("export-FAILED-*"))


def test_a_failed_check_moves_the_export_aside_and_raises(trainer, output_dir, monkeypatch):
    write = export.export_consolidated

    def export_then_drift(trainer, *args, **kwargs):
        # The trained model no longer matches what was written, as with the bf16-autocast run.
        written = write(trainer, *args, **kwargs)
        with torch.no_grad():
            trainer.model.model.norm.weight.mul_(1.5)
        return written

    monkeypatch.setattr(export, "export_consolidated", export_then_drift)
    with pytest.raises(ExportCheckError, match=r"max \|logit diff\| .* > 0.0001\. Its files were moved to .*export-FAILED-logit-diff-"):
        export_run(trainer, MODEL_ARGS, output_dir, load_base=None)

    left = {p.name for p in output_dir.iterdir()}
    assert left & EXPORTED == set(), left
    aside = next(output_dir.glob("export-FAILED-logit-diff-*"))
    assert EXPORTED <= {p.name for p in aside.iterdir()}
    assert (output_dir / "notes.txt").read_text() == "written before the export"
    assert (output_dir / "checkpoint-2" / "trainer_state.json").is_file()


def test_a_bf16_trained_model_exported_in_float32_is_checked_at_the_precision_it_trained_in(trainer, output_dir):
    """Trained under bf16 autocast (as accelerate runs `bf16: true`), exported with export_dtype: float32: the fp32
    reload differs from the trained logits by bf16 rounding only, which used to fail the fp32 tolerance of 1e-4."""
    forward = trainer.model.forward

    def autocast_forward(*args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward(*args, **kwargs)

    trainer.model.forward = autocast_forward
    trainer.args = SimpleNamespace(bf16=True, fp16=False)
    _, check = export_run(trainer, SimpleNamespace(use_peft=False, export_dtype="float32", verify_export=True),
                          output_dir, load_base=None)
    assert 1e-4 < check.max_logit_diff <= 5e-2  # bf16 rounding, within what a bf16 comparison allows
    assert EXPORTED <= {p.name for p in output_dir.iterdir()}
    assert export.logit_tolerance(torch.float32, torch.float32) == 1e-4  # an fp32 run stays checked at fp32


# ── Mixtures of experts: a near tie in a router is not a defect of the export ─────────────────────
# Router logits per layer, [positions, experts]; top 2 of 4 experts. Position 1's experts 1 and 2 tie within rounding.
TRAINED_ROUTERS = [torch.tensor([[3.0, 2.0, 0.0, -1.0], [3.0, 1.000, 0.999, -1.0], [0.0, 1.0, 2.0, 3.0]]),
                   torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])]


def test_a_position_a_near_tie_routed_elsewhere_is_left_out_of_the_comparison():
    reloaded = [TRAINED_ROUTERS[0] + torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, -0.002, 0.002, 0.0], [0.0] * 4]),
                # once routed elsewhere, a position's later layers may differ by anything: it is out already
                TRAINED_ROUTERS[1] + torch.tensor([[0.0] * 4, [5.0, 0.0, 0.0, -5.0], [0.0] * 4])]
    compared = export.positions_routed_alike(TRAINED_ROUTERS, reloaded, top_k=2, tolerance=0.05)
    assert compared.tolist() == [True, False, True]


def test_a_router_that_differs_by_more_than_the_tolerance_keeps_its_position_in():
    reloaded = [TRAINED_ROUTERS[0] + torch.tensor([[0.0] * 4, [0.0, -0.5, 0.5, 0.0], [0.0] * 4]), TRAINED_ROUTERS[1]]
    compared = export.positions_routed_alike(TRAINED_ROUTERS, reloaded, top_k=2, tolerance=0.05)
    assert compared.tolist() == [True, True, True]


def test_a_tie_that_tips_only_in_a_later_layer_is_left_out_there():
    trained = [TRAINED_ROUTERS[0], torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0], [4.0, 2.0, 1.995, 1.0]])]
    reloaded = [TRAINED_ROUTERS[0], trained[1] + torch.tensor([[0.0] * 4, [0.0] * 4, [0.0, 0.0, 0.01, 0.0]])]
    compared = export.positions_routed_alike(trained, reloaded, top_k=2, tolerance=0.05)
    assert compared.tolist() == [True, True, False]


def test_all_positions_are_compared_when_every_one_would_be_left_out():
    one = [torch.tensor([[1.0, 0.999]])]
    assert export.positions_routed_alike(one, [torch.tensor([[0.999, 1.0]])], top_k=1, tolerance=0.05).tolist() == [True]


def test_what_a_passed_check_left_out_is_in_its_card_line_and_read_back_from_the_summary():
    left_out = ("2 of 64 probe positions left out: a near tie in a router sent them to other experts in the reload "
                "(router logits within 0.05)")
    check = ExportCheck.from_summary({"export_max_logit_diff": 0.0044, "export_check_left_out": left_out})
    assert check == ExportCheck("passed", 0.0044, left_out)
    assert check.describe() == ("passed: the reloaded export reproduces the trained model's logits (max abs difference "
                                "0.0044; 2 of 64 probe positions left out: a near tie in a router sent them to other "
                                "experts in the reload (router logits within 0.05))")
    assert ExportCheck.from_summary({"export_max_logit_diff": 0.0}).describe() == (
        "passed: the reloaded export reproduces the trained model's logits (max abs difference 0)")
    assert ExportCheck.from_summary({"export_max_logit_diff": None}) == ExportCheck("skipped")


@pytest.mark.parametrize("model_type, top_k", [("gpt_oss", 2), ("llama", None), ("qwen3_5", None)])
def test_only_a_mixture_of_experts_has_its_routing_compared(model_type, top_k):
    from sft_recipes.tiny import tiny_config

    config = tiny_config(model_type)
    assert export.experts_per_token(config) == top_k == getattr(getattr(config, "text_config", config),
                                                                "num_experts_per_tok", None)
