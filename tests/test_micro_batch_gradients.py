"""Under FSDP2 with gradient accumulation, gradients stay sharded between micro-batches.

Without `sync_each_batch` (sft_recipes.distributed.reduce_scatter_every_micro_batch), accelerate's
`no_sync` keeps every FSDP unit's gradient unsharded after the first micro-batch: each rank held the
full trainable gradient (docs/traps.md).
"""

from __future__ import annotations

import json

import pytest

from fault_helpers import launch_with_faults

pytestmark = pytest.mark.fsdp


def test_each_micro_batch_reduce_scatters_and_no_rank_keeps_the_unsharded_gradient(tmp_path):
    # recipes/tiny/llama8b.yaml: gradient_accumulation_steps 2, so 2 micro-batches in the one step
    run = launch_with_faults("--max_steps", "1", "--output_dir", str(tmp_path / "run"), "--save_steps", "100",
                             "--report_to", "none", env={"PROBE_MICRO_GRADS": str(tmp_path / "grads")})
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    shards = []
    for rank in (0, 1):
        micro_batches = [json.loads(line) for line in (tmp_path / "grads" / f"rank{rank}.jsonl").read_text().splitlines()]
        assert len(micro_batches) == 2
        for held in micro_batches:
            assert held["unsharded"] == 0, (rank, held)
            assert held["sharded"] == held["shard"] < held["full"], (rank, held)
        shards.append(micro_batches[0]["shard"])
    assert sum(shards) == micro_batches[0]["full"]  # the two ranks' shards are the whole model
