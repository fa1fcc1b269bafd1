"""Stop for preemption at an optimizer-step boundary, with a checkpoint, on every rank at once.

Slurm sends SIGUSR1 before a time limit (`#SBATCH --signal=B:USR1@300`, forwarded by
scripts/slurm_multinode.sbatch) and SIGTERM on preemption; Kubernetes and most managed runtimes
send SIGTERM. The signal may reach only some ranks, so the handler only raises a flag; at the end
of every optimizer step all ranks agree on it, and if any rank has it they all save a checkpoint,
stop, and exit with REQUEUE_EXIT_CODE. `resume_from_checkpoint: auto` continues from there.
"""

from __future__ import annotations

import logging
import os
import signal

from transformers import TrainerCallback

from sft_recipes.fault.agreement import agree_max, barrier

logger = logging.getLogger(__name__)

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# sysexits.h EX_TEMPFAIL, "try again later": the process stopped cleanly and wants to be requeued.
# Under `accelerate launch` (torchrun) the launcher itself exits 1 whatever its workers return;
# the Slurm script decides to requeue from the signal it forwarded instead.
REQUEUE_EXIT_CODE = 75


class PreemptionCallback(TrainerCallback):
    """SIGTERM / SIGUSR1 on any rank -> all ranks checkpoint at the next step boundary and exit 75."""

    def __init__(self) -> None:
        self.received: int = 0  # signal number, 0 for none
        self.stopped_at_step: int | None = None
        self._previous_handlers: dict[int, object] = {}

    def _on_signal(self, signum: int, frame) -> None:
        if not self.received:
            self.received = signum
            rank = os.environ.get("RANK", "0")
            # os.write, not logging: a handler may interrupt a logging call holding its lock.
            os.write(2, f"[preemption] rank {rank} got {signal.Signals(signum).name}: checkpointing at the end of "
                        "this optimizer step, then exiting for requeue\n".encode())

    def on_train_begin(self, args, state, control, **kwargs):
        for sig in PREEMPTION_SIGNALS:
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)

    def on_step_end(self, args, state, control, **kwargs):
        signum = agree_max(self.received, args.ddp_timeout)
        if signum and state.global_step < state.max_steps:
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at_step = state.global_step
            if state.is_world_process_zero:
                logger.warning("%s received: stopping at step %d of %d with a checkpoint",
                               signal.Signals(signum).name, state.global_step, state.max_steps)

    def on_train_end(self, args, state, control, **kwargs):
        if self.stopped_at_step is None:
            for sig, handler in self._previous_handlers.items():
                signal.signal(sig, handler)
            return
        # The agreed checkpoint is complete on every rank. The first rank to exit 75 makes torchrun SIGTERM the
        # others, which may still be tearing down: from here that signal is ignored, so every rank exits 75 (a
        # requeue wrapper checks each) -- and no rank exits before every rank ignores it.
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        barrier(args.ddp_timeout)
        if state.is_world_process_zero:
            print(f"[preempted] stopped at step {self.stopped_at_step} of {state.max_steps}; checkpoint: "
                  f"{args.output_dir}/checkpoint-{self.stopped_at_step}; exit {REQUEUE_EXIT_CODE} (requeue the job: "
                  "resume_from_checkpoint: auto continues from this checkpoint)", flush=True)
        raise SystemExit(REQUEUE_EXIT_CODE)
