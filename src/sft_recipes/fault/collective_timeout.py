"""A rank that dies or hangs makes the others fail within `ddp_timeout` seconds, never wait forever.

When a worker process dies, torchrun's agent on that node sees it at once and stops the node's
other workers (SIGTERM, then SIGKILL after TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default).
Workers on other nodes, and any rank facing a hung (not dead) peer, only leave the collective they
wait in when its timeout expires: the process group's timeout, which `ddp_timeout` sets. gloo then
raises "Timed out waiting ...ms", NCCL's watchdog aborts the process; the worker exits non-zero
and its agent stops the rest of its node.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


def bound_collective_waits(training_args) -> None:
    """Apply `ddp_timeout` to the default process group (call once it exists).

    transformers 5.23 (`TrainingArguments._setup_devices`) passes `ddp_timeout` to
    `init_process_group` on GPU and DeepSpeed only: a `use_cpu` (gloo) run keeps torch's
    30-minute default, so a hung rank stalls the CPU test bed for half an hour.
    """
    if dist.is_available() and dist.is_initialized():
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=training_args.ddp_timeout))
