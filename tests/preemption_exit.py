"""Test-only worker: PreemptionCallback in a bare step loop under torchrun, for tests/test_fault_preemption_exit.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/preemption_exit.py

Each rank prints "READY rank=R" once its signal handlers are in place, steps every 50 ms until the
ranks agree to stop, then leaves through the callback's on_train_end. Rank 1 then tears down
slowly (2 s, as after a real run's export of MLflow and gloo state), so the first rank's exit 75
makes torchrun SIGTERM a rank that has not exited yet: the race that turned its 75 into -15.
"""

from __future__ import annotations

import atexit
import os
import time
from types import SimpleNamespace

import torch.distributed as dist

from sft_recipes.distributed import process_group_destroyed_on_exit
from sft_recipes.fault.preemption import PreemptionCallback

RANK = int(os.environ["RANK"])
SLOW_TEARDOWN_RANK, SLOW_TEARDOWN_SECONDS = 1, 2.0


def main() -> None:
    dist.init_process_group("gloo")
    callback = PreemptionCallback()
    args = SimpleNamespace(ddp_timeout=60, output_dir="(none)")
    state = SimpleNamespace(global_step=0, max_steps=10_000, is_world_process_zero=RANK == 0)
    control = SimpleNamespace(should_save=False, should_training_stop=False)
    callback.on_train_begin(args, state, control)
    print(f"READY rank={RANK}", flush=True)
    while not control.should_training_stop and state.global_step < state.max_steps:
        time.sleep(0.05)
        state.global_step += 1
        callback.on_step_end(args, state, control)
    if RANK == SLOW_TEARDOWN_RANK:
        atexit.register(time.sleep, SLOW_TEARDOWN_SECONDS)
    callback.on_train_end(args, state, control)


if __name__ == "__main__":
    with process_group_destroyed_on_exit():
        main()
