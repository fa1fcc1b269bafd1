"""Live throughput: real tokens/s per device, MFU against the accelerator's peak, peak memory.

FLOPs per token come from `sft_recipes.planner.model_math.flops_per_token` (6N + attention for full
fine-tuning, 4N + 6 x trainable for a frozen LoRA base), the same function the dry-run planner uses,
so the planned and the measured MFU are the same quantity.

Under sequence parallelism a rank of an N-rank group computes 1/N of its blocks: the MLPs and
projections of its chunk's tokens, and attention over the whole block for 1/N of the heads. Both
its tokens and its attention term are the block's divided by N.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field

import torch

from sft_recipes.planner.model_math import GPUS, count_parameters, flops_per_token


def accelerator_peak_flops(device: torch.device) -> tuple[float | None, str]:
    """Dense bf16 peak of this device and its name; None where MFU is not meaningful."""
    if device.type != "cuda":
        return None, f"{device.type} (MFU not meaningful: no accelerator peak)"
    name = torch.cuda.get_device_name(device)
    for gpu in GPUS:
        if gpu.name in name.upper():
            return gpu.peak_bf16_flops, name
    return None, f"{name} (no peak in the table: MFU not reported)"


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def real_tokens_and_attention_length(inputs: dict) -> tuple[int, float]:
    """Tokens that are not padding in a batch, and sum(L_i^2) for the attention FLOP term.

    Packed batches carry `cu_seq_lens_q` (documents, padding segments included: an overcount by
    the rows' unused tails; packed streams count exactly instead, from their `StreamStats`);
    padded ones an `attention_mask`.
    """
    if "cu_seq_lens_q" in inputs:
        lengths = torch.diff(inputs["cu_seq_lens_q"].to(torch.int64))
        return int(lengths.sum()), float((lengths.double() ** 2).sum())
    if "attention_mask" in inputs:
        lengths = inputs["attention_mask"].sum(dim=-1).to(torch.int64)
        return int(lengths.sum()), float((lengths.double() ** 2).sum())
    ids = inputs["input_ids"]
    return ids.numel(), float(ids.shape[-1] ** 2 * ids.shape[0])


@dataclass
class ThroughputMeter:
    """Accumulates real tokens between two logs of one rank; `report` closes the interval."""

    model_config: object
    param_counts: object
    device: torch.device
    sequence_parallel_size: int = 1  # ranks that share each block counted
    tokens: float = 0
    squared_lengths: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.peak_flops, self.device_name = accelerator_peak_flops(self.device)

    @classmethod
    def for_run(cls, model_config, lora_config, device: torch.device, sequence_parallel_size: int = 1
                ) -> ThroughputMeter:
        """Counts from the meta model of the run's architecture (LoRA applied), as the planner makes them."""
        return cls(model_config, count_parameters(model_config, lora_config), device, sequence_parallel_size)

    def describe(self) -> str:
        """What the logged MFU means for this run (or why there is none)."""
        if not self.peak_flops:
            return f"tokens/s and peak memory per device on {self.device_name}; no MFU"
        basis = ("4N + 6 x trainable per token (frozen LoRA base: no weight gradients)"
                 if self.param_counts.lora_ranks else "6N per token (full fine-tuning)")
        return (f"MFU against {self.peak_flops / 1e12:,.0f} TFLOP/s dense bf16 on {self.device_name}, "
                f"counting {basis} + causal attention; FP8 runs would be over-reported against this bf16 peak")

    def restart(self) -> None:
        self.tokens, self.squared_lengths, self.started = 0, 0.0, time.perf_counter()

    def observe(self, inputs: dict) -> None:
        self.count(*real_tokens_and_attention_length(inputs))

    def count(self, tokens: int, squared_lengths: float) -> None:
        """Add real tokens and their sum of squared example lengths (when the data path knows them exactly);
        under sequence parallelism, those of the whole blocks this rank shares."""
        self.tokens += tokens / self.sequence_parallel_size
        self.squared_lengths += squared_lengths / self.sequence_parallel_size

    def report(self) -> dict[str, float]:
        elapsed = time.perf_counter() - self.started
        metrics = {"peak_memory_gib": round(peak_memory_gib(self.device), 3)}
        if self.tokens and elapsed > 0:
            tokens_per_second = self.tokens / elapsed
            metrics["tokens_per_second_per_device"] = round(tokens_per_second, 1)
            if self.peak_flops:
                mean_length = self.squared_lengths / self.tokens  # attention cost per token ~ sum L^2 / sum L
                flops = flops_per_token(self.model_config, self.param_counts, mean_length)
                metrics["mfu"] = round(tokens_per_second * flops / self.peak_flops, 4)
        self.restart()
        return metrics
