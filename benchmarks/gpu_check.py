#!/usr/bin/env python3
"""`make gpu-check`: one command for a GPU owner (<= 10 minutes on one H100/H200). Writes a dated markdown report
under benchmarks/ to paste into an issue; exits 1 when a check fails, 2 with one `error:` line without a CUDA GPU.

    python benchmarks/gpu_check.py                 # one GPU: kernels, training steps, throughput (tiny + 1B)
    python benchmarks/gpu_check.py --large 3b      # the ~3B Llama shape instead of ~1B
    python benchmarks/gpu_check.py --dry           # the same code paths on CPU, tiny sizes (the suite runs this)

1. Kernels against our torch references, on the real model classes (random weights, no Hub):
   - flash-attn varlen (transformers' `flash_attention_2`): the tiny Llama twin (recipes/tiny/llama8b.yaml's
     `tiny:llama`) on two packed blocks from our `BlockDiagonalCollator`, bf16 on the GPU, against the same
     weights in fp32 with `sdpa` on the CPU (our packed path: block-diagonal masks from position_ids).
   - fla's `chunk_gated_delta_rule` and causal-conv1d: the shrunk random Qwen3.5 of gpu_throughput.py's kernel
     section (one packed row, `cu_seqlens`/`seq_idx`), fp32 and bf16 on the GPU, against transformers' torch
     code on the CPU in a process where the kernel packages cannot import.
   A kernel whose package is not installed (or that transformers did not bind) is reported `skipped`, never
   `pass`.
2. Training steps: the tiny Llama twin, one process, FSDP2 (`fully_shard` per decoder layer and the root) with
   `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, one AdamW step on a packed batch; then the same
   with `torch_compile: true`'s per-layer compile (`sft_recipes.compile`) and with `fp8: true`'s float8 Linear
   layers (`sft_recipes.fp8`; compute capability >= 8.9). Each must give a finite loss within
   `STEP_LOSS_TOLERANCE` of the fp32 eager loss of the same weights and batch, finite gradients, and a second
   forward after the step.
3. Throughput: gpu_throughput.py's padded/packed x plain/Liger runs for the tiny twin shape and a ~1B (or ~3B)
   Llama built from the real Llama-3.1 config with Llama-3.2 sizes, random weights: real tokens/s and MFU.

--dry runs 1-3 on the CPU with tiny sizes: kernels are reported skipped (no GPU), FSDP2 runs on gloo, compile
uses dynamo's eager backend (inductor takes ~30 s per layer on a small CPU), fp8 runs torchao's emulation.
"""

from __future__ import annotations

import argparse
import datetime
import re
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_throughput  # noqa: E402  (puts src/ on the path)
from sft_recipes.environment import set_runtime_defaults  # noqa: E402
from common import markdown_table  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO_ROOT / "benchmarks"
VERSION_PACKAGES = ("torch", "transformers", "accelerate", "trl", "triton", "flash-attn", "flash-linear-attention",
                    "fla-core", "causal-conv1d", "liger-kernel", "torchao")
# Relative max |difference| / max |reference| of logits; bf16 rounds at ~4e-3 per op and the twin is 2 layers.
FLASH_TOLERANCE = 2e-2
# A bf16 (or float8) training step's loss against the fp32 eager loss of the same weights and batch, relative.
STEP_LOSS_TOLERANCE = {"bf16": 2e-2, "bf16 + torch_compile": 2e-2, "bf16 + fp8": 5e-2}
PACKED_LENGTHS = (70, 9, 130, 20, 33, 250)  # two 256-token blocks: examples split at the block edge, as recipes do
BLOCK = 256


# ---------------------------------------------------------------------------------------------
# Environment


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment_lines(device, argv: list[str]) -> list[str]:
    import torch

    if device.type == "cuda":
        capability = "sm_%d%d" % torch.cuda.get_device_capability(device)
        memory = torch.cuda.get_device_properties(device).total_memory / 2**30
        gpu = f"{torch.cuda.get_device_name(device)} ({capability}, {memory:.0f} GiB)"
        driver = nvidia_driver()
    else:
        gpu, driver = "none (--dry: CPU, tiny sizes; nothing here is a GPU result)", "n/a"
    return [
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- GPU: {gpu}",
        f"- driver: {driver}; CUDA (torch built with): {torch.version.cuda or 'n/a'}",
        "- versions: " + ", ".join(f"{name} {package_version(name)}" for name in VERSION_PACKAGES),
        "- command: `" + " ".join(["python", "benchmarks/gpu_check.py", *argv]) + "`",
    ]


def nvidia_driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return out.splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown (nvidia-smi not found)"


# ---------------------------------------------------------------------------------------------
# 1. Kernels


def packed_batch(vocab_size: int) -> dict[str, Any]:
    """Two BLOCK-token rows from our collator over random examples of PACKED_LENGTHS."""
    import torch

    from sft_recipes.data.collator import BlockDiagonalCollator

    generator = torch.Generator().manual_seed(0)
    examples = [{"input_ids": torch.randint(3, vocab_size, (n,), generator=generator).tolist()}
                for n in PACKED_LENGTHS]
    return BlockDiagonalCollator(BLOCK, pad_token_id=0)(examples)


def tiny_llama():
    """The tiny Llama twin in fp32 with sdpa, seed 0: every caller gets the same weights (cast and switched to a
    kernel afterwards, on the device: flash-attn's checks want a half dtype on a GPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    from sft_recipes.architectures import prepare_for_packing
    from sft_recipes.tiny import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa", dtype=torch.float32)
    prepare_for_packing(model)
    return model


def to_device(batch: dict[str, Any], device) -> dict[str, Any]:
    import torch

    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def relative(candidate, reference) -> float:
    return float((candidate.float().cpu() - reference).abs().max() / reference.abs().max())


def compare_attention(attention: str, device, dtype, tolerance: float = FLASH_TOLERANCE) -> tuple[float, float, str]:
    """The tiny Llama twin's logits and loss on a packed batch with `attention` on `device` in `dtype`, against
    fp32 sdpa on the CPU: (logits difference, loss difference, pass/FAIL)."""
    import torch

    reference_model = tiny_llama().eval()
    batch = packed_batch(reference_model.config.vocab_size)
    candidate_model = tiny_llama().to(device, dtype).eval()
    candidate_model.set_attn_implementation(attention)
    with torch.no_grad():
        reference = reference_model(**batch)
        candidate = candidate_model(**to_device(batch, device))
    logits = relative(candidate.logits, reference.logits.float())
    loss = relative(candidate.loss, reference.loss.float())
    return logits, loss, "pass" if max(logits, loss) < tolerance else f"FAIL (> {tolerance:.0e})"


def flash_attention_row(device, dry: bool) -> list[Any]:
    name = "flash-attn varlen (flash_attention_2), tiny Llama twin, 2 packed blocks, bf16"
    reason = kernel_skip_reason(device, dry, "flash_attn")
    if reason:
        return [name, "", "", reason]
    import torch

    try:
        logits, loss, result = compare_attention("flash_attention_2", device, torch.bfloat16)
    except Exception as error:  # reported beside the other checks
        return [name, "", "", f"FAIL: {type(error).__name__}: {str(error)[:160]}"]
    return [name, f"{logits:.1e}", f"{loss:.1e}", result]


def kernel_skip_reason(device, dry: bool, package: str) -> str | None:
    if device.type != "cuda":
        return "skipped: no GPU (--dry)" if dry else "skipped: no GPU"
    try:
        __import__(package)
    except ImportError:
        return f"skipped: {package} not installed"
    return None


def linear_attention_rows(device, dry: bool, options: argparse.Namespace) -> tuple[list[list[Any]], list[list[Any]]]:
    """Per-kernel rows (fla, causal-conv1d) and the detailed qwen3_5 comparison rows they rest on."""
    names = {"fla": "fla chunk_gated_delta_rule (qwen3_5 linear attention)",
             "causal_conv1d": "causal-conv1d (qwen3_5 short convolution)"}
    reasons = {package: kernel_skip_reason(device, dry, package) for package in names}
    if device.type == "cuda":
        bound = gpu_throughput.bound_kernels()
        for package, is_bound in bound.items():
            if reasons[package] is None and not is_bound:
                reasons[package] = "skipped: installed but transformers did not bind it"
    if all(reasons.values()):
        return [[names[p], "", "", reasons[p]] for p in names], []
    try:
        details, _ = gpu_throughput.qwen3_5_rows(options, device)
        failed = [row for row in details if not row[-1] == "pass"]
        result = "pass" if not failed else "FAIL: " + "; ".join(f"{row[0]} {row[1]}" for row in failed)[:200]
    except Exception as error:
        details, result = [], f"FAIL: {type(error).__name__}: {str(error)[:160]}"
    worst = max((float(row[2]) for row in details[1:] if row[2]), default=None)
    rows = [[names[p], f"{worst:.1e}" if worst is not None and not reasons[p] else "", "",
             reasons[p] or result] for p in names]
    return rows, details


# ---------------------------------------------------------------------------------------------
# 2. Training steps


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def fp8_skip_reason(dry: bool) -> str | None:
    import torch

    from sft_recipes.fp8 import fp8_problem

    if dry and torch.cuda.is_available():  # sft_recipes.fp8 picks real float8 (and its all-gather) when CUDA is there
        return "skipped: --dry on a machine with a GPU: run without --dry for fp8"
    problem = fp8_problem(use_peft=False)
    return f"skipped: {problem}" if problem else None


def training_step(variant: str, device, dry: bool) -> dict[str, Any]:
    """One FSDP2 step of the tiny Llama twin in bf16 (param bf16, reduce fp32), as `variant` asks: its loss before
    the step, the loss of a second forward after it, and whether every gradient was finite."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from sft_recipes.compile import compile_decoder_layers
    from sft_recipes.fp8 import convert_to_fp8_training

    model = tiny_llama().to(device)
    attention = gpu_throughput.attention_implementation(device)  # what recipes run: flash-attn when installed
    model.set_attn_implementation(attention)  # fp32 master weights: transformers warns, the compute is bf16
    batch = to_device(packed_batch(model.config.vocab_size), device)
    detail = f"{attention}, {len(model.model.layers)} layers sharded"
    if "fp8" in variant:
        converted = convert_to_fp8_training(model, fsdp=True)
        detail += f", {len(converted)} Linear layers in float8"
    if "torch_compile" in variant:
        compiled = compile_decoder_layers(model, ["LlamaDecoderLayer"], backend="eager" if dry else "inductor")
        detail += f", {compiled} compiled"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    outputs = model(**batch)
    loss = outputs.loss
    loss.backward()
    finite = all(bool(torch.isfinite(p.grad.full_tensor()).all()) for p in model.parameters() if p.grad is not None)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        after = model(**batch).loss.item()
    return {"loss": loss.item(), "after": after, "finite": finite, "logits": str(outputs.logits.dtype).split(".")[-1],
            "detail": detail}


def training_rows(device, dry: bool) -> list[list[Any]]:
    import torch
    import torch.distributed as dist

    reference_model = tiny_llama().to(device)
    with torch.no_grad():
        reference = reference_model(**to_device(packed_batch(reference_model.config.vocab_size), device)).loss.item()
    del reference_model
    # init_method, not MASTER_ADDR/PORT: the suite runs this in its own process and must not leak them
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    rows = []
    try:
        for variant, tolerance in STEP_LOSS_TOLERANCE.items():
            label = f"FSDP2 1 process, {variant}" + (" (CPU, emulated)" if dry and "fp8" in variant else "")
            if dry and "compile" in variant:
                label += " (CPU, dynamo eager backend)"
            reason = fp8_skip_reason(dry) if "fp8" in variant else None
            if reason:
                rows.append([label, "", f"{reference:.4f}", "", "", "", reason])
                continue
            try:
                step = training_step(variant, device, dry)
            except Exception as error:
                failure = f"FAIL: {type(error).__name__}: {str(error)[:160]}"
                rows.append([label, "", f"{reference:.4f}", "", "", "", failure])
                continue
            difference = abs(step["loss"] - reference) / abs(reference)
            problems = []
            if difference >= tolerance:
                problems.append(f"loss off by {difference:.1e} > {tolerance:.0e}")
            if not step["finite"]:
                problems.append("non-finite gradients")
            if not step["after"] == step["after"]:  # NaN
                problems.append("NaN loss after the step")
            if step["logits"] != "bfloat16":  # MixedPrecisionPolicy did not cast the compute
                problems.append(f"{step['logits']} logits, not bfloat16")
            if re.search(r", 0 (Linear|compiled)", step["detail"]):  # the variant changed nothing
                problems.append(step["detail"])
            rows.append([label, step["detail"], f"{reference:.4f}", step["logits"],
                         f"{step['loss']:.4f} ({difference:.1e})", f"{step['after']:.4f}",
                         "FAIL: " + ", ".join(problems) if problems else "pass"])
    finally:
        dist.destroy_process_group()
    return rows


# ---------------------------------------------------------------------------------------------
# 3. Throughput


def throughput_options(model: str, dry: bool) -> argparse.Namespace:
    options = gpu_throughput.parse_args(["--quick"] if dry else ["--model", model])
    if dry:  # the code path, not a number: one timed step of one 512-token block (or one padded conversation)
        options.block, options.blocks_per_step, options.padded_batch, options.steps = 512, 1, 1, 1
    else:
        options.model = model
        if model == "tiny":  # its 4096-token vocabulary needs the quick stand-in tokenizer's ids
            options.tokenizer_args = {"training_conversations": 30, "vocab_size": 2000}
    return options


# ---------------------------------------------------------------------------------------------


def report(options: argparse.Namespace, argv: list[str]) -> tuple[str, bool]:
    """The markdown report and whether every check passed (skipped checks neither pass nor fail)."""
    import torch

    device = torch.device("cpu" if options.dry else "cuda")
    lines = ["### make gpu-check", "", *environment_lines(device, argv), ""]
    start = time.perf_counter()
    kernel_options = gpu_throughput.parse_args(["--quick"] if options.dry else [])
    flash = flash_attention_row(device, options.dry)
    linear, details = linear_attention_rows(device, options.dry, kernel_options)
    kernels = [flash, *linear]
    lines += [f"Kernels against our torch references (relative max |difference| / max |reference|; flash-attn "
              f"tolerance {FLASH_TOLERANCE:.0e}, fla/causal-conv1d {kernel_options.tolerance:.0e} fp32 and "
              f"{kernel_options.tolerance * 10:.0e} bf16):", "",
              markdown_table(["kernel", "logits", "loss", "result"], kernels), ""]
    if details:
        lines += ["qwen3_5 comparison the fla/causal-conv1d rows rest on:", "",
                  markdown_table(["comparison", "dtype", "max abs diff / max abs reference", "result"], details), ""]
    seconds = {"kernels": time.perf_counter() - start}
    start = time.perf_counter()
    steps = training_rows(device, options.dry)
    seconds["training steps"] = time.perf_counter() - start
    lines += ["Training steps (tiny Llama twin, packed batch, one AdamW step; loss relative to the fp32 eager loss):",
              "", markdown_table(["step", "what ran", "fp32 eager loss", "logits dtype", "step loss (relative diff)",
                                  "loss after the step", "result"], steps), ""]
    models = ["tiny"] if options.dry else ["tiny", options.large]
    throughput: list[str] = []
    for model in models:
        start = time.perf_counter()
        rows, description = gpu_throughput.throughput_rows(throughput_options(model, options.dry), device)
        lines += [f"Throughput: {description}", "",
                  markdown_table(["batches", "kernels", "real tokens/step", "real / slots", "real tokens/s", "MFU",
                                  "peak memory GiB", "last loss"], rows), ""]
        # a Liger run is skipped without liger-kernel; one that raised is a failure
        throughput += [str(row[2]) for row in rows if str(row[2]).startswith(("failed", "skipped"))]
        seconds[f"throughput {model}"] = time.perf_counter() - start
    lines.append("Seconds per section: " + ", ".join(f"{name} {value:.0f}" for name, value in seconds.items()))
    results = [row[-1] for row in kernels + details + steps] + throughput
    failed = [r for r in results if r.startswith(("FAIL", "failed"))]
    summary = (f"**{len(failed)} failed**" if failed else "**all ran checks passed**") + (
        f"; {sum(r.startswith('skipped') for r in results)} skipped")
    lines.insert(2, f"Result: {summary}")
    lines.insert(3, "")
    return "\n".join(lines), not failed


def default_output(device_name: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device_name.replace("NVIDIA", "")).strip("-") or "gpu"
    return BENCHMARKS / f"gpu_check_{datetime.date.today():%Y-%m-%d}_{slug}.md"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry", action="store_true", help="CPU, tiny sizes: the code paths, no GPU result")
    parser.add_argument("--large", choices=("1b", "3b"), default="1b", help="the larger throughput model")
    parser.add_argument("--output", help="the report's path (default: benchmarks/gpu_check_DATE_GPU.md; "
                                         "--dry: outputs/gpu_check_dry.md)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    options = parse_args(argv)
    import torch

    if not options.dry and not torch.cuda.is_available():
        print("error: make gpu-check needs a CUDA GPU and torch sees none (torch.cuda.is_available() is False): "
              "run it on a GPU machine, or `make gpu-check DRY=1` for the CPU dry run", file=sys.stderr)
        return 2
    set_runtime_defaults()  # the CUDA allocator setting a run gets; nothing on a machine without a GPU
    text, passed = report(options, argv)
    if options.output:
        output = Path(options.output)
    elif options.dry:
        output = REPO_ROOT / "outputs" / "gpu_check_dry.md"
    else:
        output = default_output(torch.cuda.get_device_name())
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text + "\n", encoding="utf-8")
    print(text)
    print(f"\nreport written to {output}" + ("" if passed else "; a check FAILED"))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
