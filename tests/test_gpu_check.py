"""`make gpu-check`: its CPU dry run goes through the same code paths as on a GPU (kernels skipped, never passed),
and its verdict and exit status follow the checks."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from test_benchmarks_smoke import number, table_rows

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("gpu_check")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_dry_run_reports_kernels_skipped_and_trains_in_bf16(gpu_check, tmp_path, capsys):
    output = tmp_path / "report.md"
    assert gpu_check.main(["--dry", "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    report = output.read_text()
    assert report in printed
    assert "- GPU: none (--dry" in report
    kernels = {row["kernel"].split(" ")[0]: row["result"] for row in table_rows(report, "kernel")}
    assert kernels == {"flash-attn": "skipped: no GPU (--dry)", "fla": "skipped: no GPU (--dry)",
                       "causal-conv1d": "skipped: no GPU (--dry)"}
    steps = {row["step"]: row for row in table_rows(report, "step")}
    bf16 = steps["FSDP2 1 process, bf16"]
    assert bf16["result"] == "pass" and bf16["logits dtype"] == "bfloat16" and bf16["what ran"] == "sdpa, 2 layers sharded"
    assert number(bf16["loss after the step"]) < number(bf16["fp32 eager loss"])  # the AdamW step learned
    compiled = steps["FSDP2 1 process, bf16 + torch_compile (CPU, dynamo eager backend)"]
    assert compiled["result"] == "pass" and compiled["logits dtype"] == "bfloat16"
    assert compiled["what ran"] == "sdpa, 2 layers sharded, 2 compiled"
    fp8 = steps["FSDP2 1 process, bf16 + fp8 (CPU, emulated)"]
    assert fp8["result"] == "pass", fp8  # torchao (requirements-test.txt) emulates float8 on CPU
    assert fp8["what ran"] == "sdpa, 2 layers sharded, 14 Linear layers in float8"  # q, k, v, o, gate, up, down x 2
    throughput = [row for row in table_rows(report, "batches") if row["kernels"] == "plain"]
    assert [row["batches"] for row in throughput] == ["padded", "packed"]
    assert all(number(row["real tokens/s"]) > 0 and row["MFU"] == "n/a" for row in throughput)
    assert report.splitlines()[2] == "Result: **all ran checks passed**; 5 skipped"  # 3 kernels + 2 Liger rows


def test_attention_comparison_passes_the_reference_and_fails_a_bf16_candidate_at_fp32_tolerance(gpu_check):
    # the GPU's flash-attn comparison, with sdpa as the candidate: fp32 against itself is exact ...
    assert gpu_check.compare_attention("sdpa", torch.device("cpu"), torch.float32) == (0.0, 0.0, "pass")
    # ... and a bf16 candidate is caught by a tolerance below bf16's rounding: the comparison can fail
    logits, loss, result = gpu_check.compare_attention("sdpa", torch.device("cpu"), torch.bfloat16, tolerance=1e-6)
    assert 1e-6 < logits < gpu_check.FLASH_TOLERANCE and result == "FAIL (> 1e-06)"


def test_a_missing_kernel_package_is_skipped_on_a_gpu(gpu_check):
    reason = gpu_check.kernel_skip_reason(torch.device("cuda"), dry=False, package="no_such_kernel_package")
    assert reason == "skipped: no_such_kernel_package not installed"


def test_a_failing_check_exits_1_and_says_so(gpu_check, monkeypatch, tmp_path, capsys):
    failed = ["FSDP2 1 process, bf16", "", "6.2", "bfloat16", "9.0 (4.5e-01)", "9.0", "FAIL: loss off"]
    monkeypatch.setattr(gpu_check, "training_rows", lambda device, dry: [failed])
    monkeypatch.setattr(gpu_check.gpu_throughput, "throughput_rows", lambda options, device: ([], "none"))
    output = tmp_path / "report.md"
    assert gpu_check.main(["--dry", "--output", str(output)]) == 1
    assert output.read_text().splitlines()[2] == "Result: **1 failed**; 3 skipped"
    assert capsys.readouterr().out.endswith("; a check FAILED\n")


def test_without_a_gpu_one_error_line_and_exit_2(gpu_check, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--output", str(tmp_path / "never.md")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not (tmp_path / "never.md").exists()
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: make gpu-check needs a CUDA GPU")


def test_default_report_name_is_dated_and_names_the_gpu(gpu_check):
    path = gpu_check.default_output("NVIDIA H200 NVL")
    assert path.parent == BENCHMARKS and path.name.startswith("gpu_check_20") and path.name.endswith("_H200-NVL.md")


def test_gpu_throughput_sizes_and_the_tiny_models_vocabulary(gpu_check):
    large = gpu_check.throughput_options("3b", dry=False)
    assert (large.model, large.block, large.blocks_per_step, large.steps, large.tokenizer_args) == ("3b", 8192, 2, 10, {})
    tiny = gpu_check.throughput_options("tiny", dry=False)
    # the Llama-3 stand-in's ids (128k) would overflow the tiny shape's embedding; the quick tokenizer's fit it
    assert tiny.tokenizer_args["vocab_size"] <= gpu_check.gpu_throughput.MODEL_SIZES["tiny"]["vocab_size"]
    assert gpu_check.parse_args([]).large == "1b"
