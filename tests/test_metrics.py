"""Live throughput figures: real tokens counted from the batch, MFU from the planner's FLOP function."""

from __future__ import annotations

import time

import pytest
import torch

from sft_recipes.metrics import ThroughputMeter, real_tokens_and_attention_length
from sft_recipes.planner.model_math import count_parameters, flops_per_token
from sft_recipes.tiny import tiny_config


def test_padded_batch_counts_only_attended_tokens():
    batch = {"input_ids": torch.zeros(2, 5, dtype=torch.long),
             "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])}
    assert real_tokens_and_attention_length(batch) == (8, 3**2 + 5**2)


def test_packed_batch_counts_documents_from_cu_seq_lens():
    batch = {"input_ids": torch.zeros(1, 10, dtype=torch.long), "cu_seq_lens_q": torch.tensor([0, 3, 7, 10], dtype=torch.int32)}
    assert real_tokens_and_attention_length(batch) == (10, 3**2 + 4**2 + 3**2)


def test_mfu_uses_the_planner_flops_and_the_peak(monkeypatch):
    config = tiny_config("llama")
    counts = count_parameters(config)
    meter = ThroughputMeter(config, counts, torch.device("cpu"))
    assert meter.peak_flops is None and "no MFU" in meter.describe()
    peak = 10 * flops_per_token(config, counts, 4.0)  # as if on an accelerator: MFU ~ 0.4 at 4 tokens/s
    meter.peak_flops = peak
    meter.observe({"input_ids": torch.zeros(1, 8, dtype=torch.long), "cu_seq_lens_q": torch.tensor([0, 4, 8])})
    meter.started = time.perf_counter() - 2.0
    report = meter.report()
    assert report["tokens_per_second_per_device"] == pytest.approx(4.0, rel=0.01)
    assert report["mfu"] == pytest.approx(4.0 * flops_per_token(config, counts, 4.0) / peak, rel=0.01)
    assert meter.tokens == 0  # the interval restarts after each report


def test_a_rank_sharing_blocks_counts_its_share_of_tokens_and_attention(monkeypatch):
    """Sequence parallelism over 2 ranks: each computes half the block's tokens and half its attention."""
    config = tiny_config("llama")
    counts = count_parameters(config)
    meter = ThroughputMeter(config, counts, torch.device("cpu"), sequence_parallel_size=2)
    meter.peak_flops = 1e6
    meter.count(8, 4**2 + 4**2)  # one 8-token block of two 4-token documents
    assert (meter.tokens, meter.squared_lengths) == (4, 16)
    meter.started = time.perf_counter() - 2.0
    report = meter.report()
    assert report["tokens_per_second_per_device"] == pytest.approx(2.0, rel=0.01)
    assert report["mfu"] == pytest.approx(2.0 * flops_per_token(config, counts, 4.0) / 1e6, rel=0.01)
