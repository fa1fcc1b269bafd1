#!/usr/bin/env python3
"""GPU training throughput (padded vs packed, with and without Liger), the qwen3_5 kernel check, and
sequence parallelism at SP 1/2/4.

    python benchmarks/gpu_throughput.py                   # one GPU, ~3 minutes; 1B model
    python benchmarks/gpu_throughput.py --model 3b        # Llama-3.2-3B shape (fits one H200)
    python benchmarks/gpu_throughput.py --quick --device cpu   # smoke run of the code path, no GPU

1. Throughput: a Llama-architecture model initialised at random from the real Llama-3.1 config
   with the sizes of Llama-3.2-1B (or -3B), bf16, on UltraChat-like conversations tokenized with
   assistant masks (``corpus.py``, Llama-3 stand-in tokenizer). Four runs on the same weights:
   padded batches (``--padded-batch`` conversations padded to the longest) and packed blocks
   (``fill_blocks`` + ``BlockDiagonalCollator``, ``--blocks-per-step`` x ``--block`` tokens), each
   without and with Liger kernels applied the way ``use_liger_kernel=True`` applies them
   (``transformers.integrations.liger.apply_liger_kernel``: fused linear cross-entropy, RMSNorm,
   RoPE, SwiGLU). Reported: real (non-padding) tokens/s after warm-up, MFU against the GPU's dense
   bf16 peak with the FLOPs ``sft_recipes.planner.model_math.flops_per_token`` counts (6N + causal attention per
   document, the same MFU the training run logs), peak memory.
2. qwen3_5 kernels: a shrunk random Qwen3.5 (the preflight's model: real layer pattern and head
   dims, slow gates so a leak would be large) runs one packed row of 4 examples with
   ``seq_idx``/``cu_seqlens`` through the real kernels (causal-conv1d, fla's gated-delta rule) on the
   GPU, against the CPU reference (transformers' torch code made segment-aware by
   ``prepare_for_packing``, run in a process where the kernel packages cannot import). Outputs must
   agree to ``--tolerance`` (relative); the kernels that were bound are named, so a run without them
   says so instead of comparing the fallback with itself unnoticed.
3. Sequence parallelism: the same Llama model trained on ``--sp-block``-token packed blocks by
   groups of ``--sequence-parallel`` sizes (default 1,2,4) of processes, one GPU each (NCCL; gloo on
   CPU), with ``sft_recipes.architectures.sequence_parallel`` (each rank holds ``1/N`` of a block,
   all-to-all around attention) and the step's loss as the global token mean. Each rank keeps a
   full model replica (no FSDP, no gradient reduction), so the figures isolate what SP changes: the
   per-rank activations and the all-to-all. Reported: block tokens/s of the group and per GPU, and
   the largest peak memory over the group's ranks, and the first step's loss (the same block and
   weights at every size: it must agree). A size needing more GPUs than the machine has is reported
   as skipped.

Needs the project's requirements; flash-attn, liger-kernel, flash-linear-attention and
causal-conv1d are used when installed and reported as missing otherwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment_header, markdown_table  # noqa: E402
from corpus import REALWORLD_DIR  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(REPO_ROOT / "src"))  # works without an editable install of sft_recipes too
from sft_recipes.environment import set_runtime_defaults  # noqa: E402

# Llama-3.2 shapes (the 1B and 3B members of the Llama-3 family); everything else from Llama-3.1-8B's config.
MODEL_SIZES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    # --quick only: the quick stand-in tokenizer's ids fit a 4096-token vocabulary.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, vocab_size=4096),
}
QWEN_EXAMPLE_LENGTHS = (300, 77, 1000, 150)  # not multiples of fla's 64-token chunks
QUICK_QWEN_EXAMPLE_LENGTHS = (70, 9, 130, 20)
KERNEL_PACKAGES = ("fla", "causal_conv1d")
SEQUENCE_PARALLEL_SIZES = (1, 2, 4)
QUICK_SEQUENCE_PARALLEL_SIZES = (1, 2)


# ---------------------------------------------------------------------------------------------
# 1. Throughput


def llama_config(size: str):
    from transformers import LlamaConfig

    real = json.loads((REALWORLD_DIR / "model_configs" / "meta-llama__Llama-3.1-8B.json").read_text())
    for key in ("architectures", "model_type", "transformers_version", "torch_dtype"):
        real.pop(key, None)
    real.update(MODEL_SIZES[size], use_cache=False)
    return LlamaConfig(**real)


def training_examples(conversations: int, tokenizer_args: dict[str, Any]) -> list[dict[str, list[int]]]:
    from corpus import standin_tokenizer, ultrachat_like
    from sft_recipes.data.blocks import IGNORE_INDEX
    from sft_recipes.data.masking import tokenize_conversations

    tokenizer = standin_tokenizer("llama3.1", **tokenizer_args)
    columns = tokenize_conversations(tokenizer, ultrachat_like(conversations, seed=0))
    return [
        {"input_ids": ids, "labels": [t if keep else IGNORE_INDEX for t, keep in zip(ids, mask)]}
        for ids, mask in zip(columns["input_ids"], columns["assistant_masks"])
    ]


def padded_batches(examples: list[dict], batch_size: int, max_length: int, pad_token_id: int):
    """Rows padded to the longest of each batch (TRL's default collator), cut at ``max_length``."""
    import torch

    for start in range(0, len(examples) - batch_size + 1, batch_size):
        rows = [{k: v[:max_length] for k, v in e.items()} for e in examples[start : start + batch_size]]
        width = max(len(r["input_ids"]) for r in rows)
        input_ids = torch.full((batch_size, width), pad_token_id)
        labels = torch.full((batch_size, width), -100)
        attention_mask = torch.zeros((batch_size, width), dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            input_ids[i, :n] = torch.tensor(row["input_ids"])
            labels[i, :n] = torch.tensor(row["labels"])
            attention_mask[i, :n] = 1
        lengths = [len(r["input_ids"]) for r in rows]
        yield {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}, lengths


def packed_batches(examples: list[dict], blocks_per_step: int, block: int, pad_token_id: int):
    """``[blocks_per_step, block]`` block-diagonal rows, as the recipes' packed streams build them."""
    from sft_recipes.data.blocks import fill_blocks
    from sft_recipes.data.collator import BlockDiagonalCollator

    collator = BlockDiagonalCollator(block, pad_token_id, block_per_row=True)
    blocks = [b for b in fill_blocks(examples, block) if len(b["input_ids"]) == block]
    for start in range(0, len(blocks) - blocks_per_step + 1, blocks_per_step):
        step = blocks[start : start + blocks_per_step]
        yield collator(step), [n for b in step for n in b["seq_lengths"]]


def attention_implementation(device) -> str:
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def run_config(model, batches, steps: int, warmup: int, device) -> dict[str, Any]:
    """Train ``warmup`` + ``steps`` steps; real tokens, sum of squared document lengths and time of the last
    ``steps``."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tokens = squares = slots = 0
    start = None
    for index, (batch, lengths) in enumerate(batches):
        if index == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if index >= warmup:
            tokens += sum(lengths)
            squares += sum(n * n for n in lengths)
            slots += batch["input_ids"].numel()
        if index + 1 == warmup + steps:
            break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if start is None or tokens == 0:
        raise ValueError(f"not enough data for {warmup} + {steps} steps: raise --conversations")
    seconds = time.perf_counter() - start
    memory = f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f}" if device.type == "cuda" else "n/a"
    return {"seconds": seconds, "tokens": tokens, "squares": squares, "slots": slots, "loss": loss.item(),
            "memory_gib": memory}


def throughput_rows(options: argparse.Namespace, device) -> tuple[list[list[Any]], str]:
    import torch
    from transformers import LlamaForCausalLM

    from sft_recipes.metrics import accelerator_peak_flops
    from sft_recipes.planner.model_math import count_parameters, flops_per_token

    config = llama_config(options.model)
    attention = attention_implementation(device)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = LlamaForCausalLM._from_config(config, attn_implementation=attention, dtype=dtype).to(device)
    model.train()
    counts = count_parameters(config)
    peak, device_name = accelerator_peak_flops(device)
    examples = training_examples(options.conversations, options.tokenizer_args)
    pad = 0  # the loss never sees pad slots (labels -100); the id itself does not matter
    rows = []
    for liger in (False, True):
        if liger:
            try:
                from transformers.integrations.liger import apply_liger_kernel

                apply_liger_kernel(model, {})  # what use_liger_kernel=True does in the Trainer
            except ImportError as missing:
                rows += [[name, "liger", f"skipped: {missing}", "", "", "", "", ""] for name in ("padded", "packed")]
                break
        for name, batches in (
            ("padded", padded_batches(examples, options.padded_batch, options.block, pad)),
            ("packed", packed_batches(examples, options.blocks_per_step, options.block, pad)),
        ):
            label = "liger" if liger else "plain"
            try:
                run = run_config(model, batches, options.steps, options.warmup, device)
            except Exception as error:  # one failing combination must not hide the others
                rows.append([name, label, f"failed: {type(error).__name__}: {str(error)[:160]}", "", "", "", "", ""])
                continue
            tokens_per_second = run["tokens"] / run["seconds"]
            flops = flops_per_token(config, counts, run["squares"] / run["tokens"])
            mfu = f"{tokens_per_second * flops / peak:.1%}" if peak else "n/a"
            rows.append([name, label, f"{run['tokens'] / options.steps:,.0f}", f"{run['tokens'] / run['slots']:.1%}",
                         f"{tokens_per_second:,.0f}", mfu, run["memory_gib"], f"{run['loss']:.3f}"])
    description = (f"{options.model} Llama ({counts.total / 1e6:,.0f}M parameters, random init), {dtype}, "
                   f"attention {attention}, on {device_name}; {options.warmup} warm-up + {options.steps} timed steps; "
                   f"padded: {options.padded_batch} conversations per step; packed: {options.blocks_per_step} x "
                   f"{options.block} tokens per step.")
    return rows, description


# ---------------------------------------------------------------------------------------------
# 2. qwen3_5: real kernels against the CPU reference


def qwen3_5_model():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from sft_recipes.architectures.preflight import shrink_config
    from sft_recipes.architectures.registry import PACKING_QUIRKS
    from sft_recipes.tiny import real_config_dict

    real = dict(real_config_dict("qwen3_5"))
    config = shrink_config(AutoConfig.for_model(real.pop("model_type"), **real))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    PACKING_QUIRKS[config.model_type].expose_leaks(model)
    return model


def qwen3_5_outputs(model, device, lengths: tuple[int, ...]) -> dict[str, Any]:
    """Logits and loss of the packed row, and each example's logits run alone."""
    import torch

    from sft_recipes.data.collator import pack_kwargs
    from sft_recipes.architectures.registry import prepare_for_packing

    prepare_for_packing(model)
    model.to(device).eval()
    generator = torch.Generator().manual_seed(0)
    examples = [torch.randint(0, model.config.vocab_size, (n,), generator=generator) for n in lengths]
    row = torch.cat(examples).unsqueeze(0)
    kwargs = pack_kwargs(lengths, labels=row)
    kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
    with torch.no_grad():
        packed = model(input_ids=row.to(device), use_cache=False, **kwargs)
        alone = [model(input_ids=ids.unsqueeze(0).to(device), use_cache=False).logits[0] for ids in examples]
    return {"packed": packed.logits[0].float().cpu(), "loss": packed.loss.float().cpu(),
            "separate": torch.cat(alone).float().cpu()}


def bound_kernels() -> dict[str, bool]:
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from sft_recipes.architectures.kernels import kernel_bound

    return {"causal_conv1d": kernel_bound(modeling_qwen3_5.causal_conv1d_fn),
            "fla": kernel_bound(modeling_qwen3_5.torch_chunk_gated_delta_rule)}


def qwen3_5_reference_child(directory: str, lengths: tuple[int, ...]) -> None:
    """CPU reference in a process where the kernel packages cannot import (transformers binds them at import)."""
    for package in KERNEL_PACKAGES:
        sys.modules[package] = None  # type: ignore[assignment]
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa")
    assert not any(bound_kernels().values()), "the reference must run transformers' torch code"
    torch.save(qwen3_5_outputs(model, torch.device("cpu"), lengths), Path(directory) / "reference.pt")


def qwen3_5_rows(options: argparse.Namespace, device) -> tuple[list[list[Any]], str]:
    import torch

    kernels = bound_kernels()
    with tempfile.TemporaryDirectory(prefix="bench-qwen3_5-") as directory:
        qwen3_5_model().save_pretrained(directory)
        lengths = ",".join(map(str, options.qwen_lengths))
        subprocess.run([sys.executable, __file__, "--qwen3-5-reference", directory, "--qwen-lengths", lengths],
                       check=True)
        reference = torch.load(Path(directory) / "reference.pt")

    def relative(a, b) -> float:
        return float((a - b).abs().max() / b.abs().max())

    leak = relative(reference["packed"], reference["separate"])
    rows = [["CPU reference: packed vs examples alone", "fp32", f"{leak:.1e}",
             "pass" if leak < options.tolerance else "FAIL"]]
    runs = [("fp32", torch.float32, "sdpa")]
    if device.type == "cuda":
        runs.append(("bf16", torch.bfloat16, attention_implementation(device)))
    for label, dtype, attention in runs:
        candidate = qwen3_5_model().to(dtype)
        try:
            candidate.set_attn_implementation(attention)
            outputs = qwen3_5_outputs(candidate, device, options.qwen_lengths)
        except Exception as error:  # report it next to the other comparisons
            rows.append([f"{device.type} {attention}", label, "", f"FAIL: {type(error).__name__}: {str(error)[:160]}"])
            continue
        tolerance = options.tolerance if dtype == torch.float32 else options.tolerance * 10
        for name, key in (("packed logits", "packed"), ("loss", "loss"), ("examples alone", "separate")):
            difference = relative(outputs[key], reference[key])
            rows.append([f"{device.type} {attention} vs CPU reference: {name}", label, f"{difference:.1e}",
                         "pass" if difference < tolerance else f"FAIL (> {tolerance:.0e})"])
    path = ", ".join(f"{name}: {'kernel' if bound else 'torch fallback'}" for name, bound in kernels.items())
    description = (f"Shrunk random Qwen3.5 (preflight model, slow gates), examples of {options.qwen_lengths} tokens "
                   f"in one row; {path}.")
    if not any(kernels.values()):
        description += " No kernel package is installed here: this compares the torch fallback with itself."
    return rows, description


# ---------------------------------------------------------------------------------------------
# 3. Sequence parallelism


def parse_sequence_parallel_sizes(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4); ``""`` -> () (the section is skipped)."""
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sequence-parallel takes sizes like 1,2,4, got {text!r}") from None
    if any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"--sequence-parallel sizes must be at least 1, got {text!r}")
    return sizes


def sequence_parallel_size_skip_reason(size: int, block: int, device_type: str, devices: int) -> str | None:
    """Why ``size`` cannot run here, or None."""
    if block % size:
        return f"skipped: the {block}-token block does not split into {size} chunks"
    if device_type == "cuda" and size > devices:
        return f"skipped: needs {size} GPUs, this machine has {devices}"
    return None


def sequence_parallel_worker(rank: int, size: int, port: int, options: argparse.Namespace, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from sft_recipes.architectures import prepare_for_packing
    from sft_recipes.architectures.sequence_parallel import enable_sequence_parallel, new_sequence_parallel_group
    from sft_recipes.data.sequence_shards import shard_block
    from sft_recipes.token_loss import global_token_mean, summed_token_loss

    cuda = options.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    try:
        layout, group = new_sequence_parallel_group(size)
        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(llama_config(options.model), attn_implementation=attention_implementation(
            device), dtype=torch.bfloat16 if cuda else torch.float32).to(device)
        prepare_for_packing(model)
        enable_sequence_parallel(model, group)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
        examples = training_examples(options.conversations, options.tokenizer_args)
        batches = packed_batches(examples, 1, options.sp_block, pad_token_id=0)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        start, tokens, first_loss = None, 0, None
        for index, (batch, _) in enumerate(batches):
            if index == options.warmup:
                if cuda:
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
            shard = shard_block(batch, layout.sp_rank, size)
            targets = shard.pop("shift_labels").to(device)
            shard = {k: v.to(device) if torch.is_tensor(v) else v for k, v in shard.items()}
            logits = model(**shard, use_cache=False).logits
            share, loss = global_token_mean(*summed_token_loss(logits, targets), group=group)
            share.backward()
            first_loss = loss.item() if first_loss is None else first_loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if index >= options.warmup:
                tokens += batch["input_ids"].numel()
            if index + 1 == options.warmup + options.steps:
                break
        if cuda:
            torch.cuda.synchronize(device)
        if start is None or tokens == 0:
            raise ValueError(f"not enough data for {options.warmup} + {options.steps} blocks: raise --conversations")
        result = {"seconds": time.perf_counter() - start, "tokens": tokens, "first_loss": first_loss,
                  "memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def sequence_parallel_rows(options: argparse.Namespace, device) -> tuple[list[list[Any]], str]:
    import socket

    import torch
    import torch.multiprocessing as mp

    devices = torch.cuda.device_count() if device.type == "cuda" else 0
    rows = []
    for size in options.sequence_parallel:
        reason = sequence_parallel_size_skip_reason(size, options.sp_block, device.type, devices)
        if reason:
            rows.append([size, reason, "", "", ""])
            continue
        with tempfile.TemporaryDirectory() as out_dir, socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
            probe.close()
            try:
                mp.spawn(sequence_parallel_worker, args=(size, port, options, out_dir), nprocs=size)
            except Exception as error:  # one failing size must not hide the others
                rows.append([size, f"failed: {type(error).__name__}: {str(error)[-160:]}", "", "", ""])
                continue
            results = [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(size)]
        seconds = max(result["seconds"] for result in results)  # the group steps together
        memory = [result["memory_gib"] for result in results]
        rows.append([size, f"{results[0]['tokens'] / seconds:,.0f}", f"{results[0]['tokens'] / seconds / size:,.0f}",
                     "n/a" if None in memory else f"{max(memory):.1f}", f"{results[0]['first_loss']:.4f}"])
    description = (f"Sequence parallelism: {options.model} Llama, {options.sp_block}-token packed blocks, one block "
                   f"per group per step, {options.warmup} warm-up + {options.steps} timed steps; a full replica per "
                   "rank (no FSDP): what changes is the per-rank share of the block and the all-to-all.")
    return rows, description


# ---------------------------------------------------------------------------------------------


def report(options: argparse.Namespace, argv: list[str]) -> str:
    import torch

    device = torch.device(options.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark needs a GPU (or --device cpu --quick for a smoke run)")
    lines = [environment_header("GPU training throughput and qwen3_5 kernels", argv)]
    throughput, description = throughput_rows(options, device)
    lines += [description, "", markdown_table(["batches", "kernels", "real tokens/step", "real / slots",
                                               "real tokens/s", "MFU", "peak memory GiB", "last loss"], throughput), ""]
    qwen, description = qwen3_5_rows(options, device)
    lines += [description, "",
              markdown_table(["comparison", "dtype", "max abs diff / max abs reference", "result"], qwen), ""]
    if options.sequence_parallel:
        rows, description = sequence_parallel_rows(options, device)
        lines += [description, "", markdown_table(["SP size", "block tokens/s (group)", "tokens/s per GPU",
                                                   "peak memory GiB (max over ranks)", "first loss"], rows), ""]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model and data: checks the code path only")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="1b")
    parser.add_argument("--conversations", type=int, default=500)
    parser.add_argument("--block", type=int, default=8192, help="packed block length (and padded rows' cut)")
    parser.add_argument("--blocks-per-step", type=int, default=2)
    parser.add_argument("--padded-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=1e-2, help="relative, fp32 (bf16: 10x)")
    parser.add_argument("--qwen-lengths", default=",".join(map(str, QWEN_EXAMPLE_LENGTHS)))
    parser.add_argument("--sequence-parallel", type=parse_sequence_parallel_sizes, default=SEQUENCE_PARALLEL_SIZES,
                        help="SP sizes to time, e.g. 1,2,4 (one GPU per rank); empty to skip")
    parser.add_argument("--sp-block", type=int, default=32768, help="packed block length of the SP runs")
    parser.add_argument("--output", help="also write the report to this file")
    parser.add_argument("--qwen3-5-reference", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    options.tokenizer_args = {}
    options.qwen_lengths = tuple(int(n) for n in options.qwen_lengths.split(","))
    if options.quick:
        options.qwen_lengths = QUICK_QWEN_EXAMPLE_LENGTHS
        options.model, options.conversations, options.block, options.blocks_per_step = "tiny", 12, 1024, 2
        options.padded_batch, options.steps, options.warmup = 2, 2, 1
        options.sp_block = 512
        if options.sequence_parallel == SEQUENCE_PARALLEL_SIZES:
            options.sequence_parallel = QUICK_SEQUENCE_PARALLEL_SIZES
        options.tokenizer_args = {"training_conversations": 30, "vocab_size": 2000}
    return options


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    options = parse_args(argv)
    if options.qwen3_5_reference:
        qwen3_5_reference_child(options.qwen3_5_reference, options.qwen_lengths)
        return 0
    set_runtime_defaults()  # the CUDA allocator setting a run gets; nothing on a machine without a GPU
    text = report(options, [__file__, *argv])
    print(text)
    if options.output:
        Path(options.output).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
