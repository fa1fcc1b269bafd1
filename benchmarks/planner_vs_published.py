#!/usr/bin/env python3
"""The planner's step-time estimates next to other people's published measurements (not ours).

    .venv/bin/python benchmarks/planner_vs_published.py            # the table of benchmarks/planner_vs_published.md
    .venv/bin/python benchmarks/planner_vs_published.py --quick    # the same (it is arithmetic: seconds)

1. torchtitan (pytorch/torchtitan docs/performance.md, Table 1): Llama-3.1-8B, 8 x H100 (Grand
   Teton: 96 GB HBM2e, 500 W, 400 Gb/s per GPU), FSDP 8, local batch 2 x 8192 tokens, bf16 with fp32
   reduction, selective activation checkpointing: 5,762 tokens/s/GPU eager, 6,667 with torch.compile
   (33-39% MFU by their count).
2. pith-train (mlc-ai/pith-train PR #40): Qwen3-30B-A3B on 8 nodes x 8 H100, 4096-token sequences,
   micro-batch 1, global batch 1024, bf16: FSDP ~293k tokens/s, HSDP ~392k (1.34x), peak memory
   48.3 -> 53.9 GB. Their run also uses pipeline parallelism 4 and expert parallelism 8, which this
   project neither runs nor models: the planner is given the same model, batch and machine with
   FSDP over 64 GPUs against HSDP 8 x 8, and only the ratio is compared.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment_header  # noqa: E402

from sft_recipes.loading import read_model_config  # noqa: E402
from sft_recipes.planner.communication import Links, MeshLayout  # noqa: E402
from sft_recipes.planner.layouts import price  # noqa: E402
from sft_recipes.planner.model_math import count_parameters  # noqa: E402
from sft_recipes.planner.setup import TrainingSetup  # noqa: E402
from sft_recipes.tiny import REALWORLD_DIR  # noqa: E402

LLAMA_8B = REALWORLD_DIR / "model_configs" / "meta-llama__Llama-3.1-8B.json"


def qwen3_30b_a3b_config():
    """Qwen/Qwen3-30B-A3B's config.json (its published architecture values; no weights, no Hub)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True)


def tokens_per_second_per_gpu(option) -> float:
    s = option.setup
    return s.tokens_per_rank * s.gradient_accumulation_steps / option.step_seconds


def torchtitan_rows(mfu: float) -> list[list[str]]:
    config = read_model_config(LLAMA_8B, download=False)
    counts = count_parameters(config)
    setup = TrainingSetup(world_size=8, micro_batch_size=2, seq_len=8192, reduce_dtype=torch.float32, mfu=mfu)
    option = price(config, counts, setup, MeshLayout(1, 8, 1), "H100", Links.for_gpu("H100"))
    predicted = tokens_per_second_per_gpu(option)
    rows = []
    for label, measured in (("eager", 5762), ("torch.compile", 6667)):
        rows.append([f"Llama-3.1-8B, 8 x H100, FSDP 8, 2 x 8192, {label}", f"{measured:,} tokens/s/GPU",
                     f"{predicted:,.0f} tokens/s/GPU ({option.communication.bound}-bound, exposed "
                     f"{option.communication.exposed_seconds * 1e3:.0f} ms of {option.step_seconds:.2f} s)",
                     f"{predicted / measured:.2f}"])
    rows.append(["same, memory per GPU", "82.4 / 77.0 GiB (eager / compile; selective AC)",
                 f"{option.memory_gib:.1f} GiB (full AC, TRL's fused head: not their setup)", "-"])
    return rows


def pith_rows(mfu: float) -> list[list[str]]:
    config = qwen3_30b_a3b_config()
    counts = count_parameters(config)
    setup = TrainingSetup(world_size=64, micro_batch_size=1, seq_len=4096, gradient_accumulation_steps=1024 // 64,
                          reduce_dtype=torch.float32, mfu=mfu)
    links = Links.for_gpu("H100")
    flat, hsdp = (price(config, counts, setup, MeshLayout(8, 8, replicate), "H100", links) for replicate in (1, 8))
    measured = {"FSDP": 293e3, "HSDP": 392e3}
    rows = []
    for name, option in (("FSDP", flat), ("HSDP", hsdp)):
        total = tokens_per_second_per_gpu(option) * 64
        rows.append([f"Qwen3-30B-A3B, 8 x 8 H100, {option.layout.name}, 1 x 4096 x 16 accumulation",
                     f"{measured[name] / 1e3:,.0f}k tokens/s", f"{total / 1e3:,.0f}k tokens/s "
                     f"({option.communication.bound}-bound, exposed {option.communication.exposed_seconds:.2f} s "
                     f"of {option.step_seconds:.2f} s)", f"{total / measured[name]:.2f}"])
    gain = flat.step_seconds / hsdp.step_seconds
    rows.append(["HSDP / FSDP speed-up", "1.34x", f"{gain:.2f}x", f"{gain / 1.34:.2f}"])
    rows.append(["HSDP - FSDP memory per GPU", "+5.6 GB (48.3 -> 53.9)",
                 f"+{(hsdp.memory_gib - flat.memory_gib) * 1.073741824:.1f} GB ({flat.memory_gib:.1f} -> "
                 f"{hsdp.memory_gib:.1f} GiB; no PP / EP: not their layout)", "-"])
    return rows


def table(rows: list[list[str]]) -> str:
    header = ["setup", "published (their measurement)", "planner estimate (ours)", "estimate / published"]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the same report (kept for tests/test_benchmarks_smoke.py)")
    parser.add_argument("--mfu", type=float, default=0.4, help="the planner's assumed MFU of the compute (default 0.4)")
    options = parser.parse_args(argv)
    print(environment_header("Planner estimates vs. published measurements", argv=[sys.argv[0], *(argv or [])]))
    print()
    print(f"Estimates at {options.mfu:.0%} MFU of the compute, H100 link table (NVLink 3,600 Gb/s, network "
          "400 Gb/s per GPU each way, 80% achieved). These are our planner's estimates set against other "
          "people's measurements on their machines; nothing here was measured by this project.")
    print()
    print(table(torchtitan_rows(options.mfu) + pith_rows(options.mfu)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
