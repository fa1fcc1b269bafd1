"""Skip optimizer steps whose gradient norm is not finite; stop with a checkpoint after N in a row.

A NaN/inf loss puts NaN/inf into the gradients (backprop carries it), so one check on the global
gradient norm catches both; it is non-finite exactly when the Trainer's logged `grad_norm` is (a
gradient replicated on every rank is counted once per rank, which changes the value, never its
finiteness). The check runs after the Trainer clipped the gradients and before `optimizer.step()`:
every rank drops its gradients (`grad = None`), which makes torch optimizers leave those parameters
and their state untouched (no update, no weight decay, no Adam step). The step still counts:
`global_step` and the learning-rate schedule advance.
"""

from __future__ import annotations

import logging
import math
import sys

import torch
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback

from sft_recipes.fault.agreement import agree_sum
from sft_recipes.refusal_exit import refusing_together
from sft_recipes.reporting.tracking import mlflow_enabled

logger = logging.getLogger(__name__)
NONFINITE_STOP_EXIT_CODE = 1  # not a refusal (2): nothing in the recipe or the command is wrong as such


def local_grad_norm_squared(model: torch.nn.Module) -> float:
    """Squared norm of this rank's gradient shards (the FSDP2-local parts of DTensor gradients)."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
             for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.nn.utils.get_total_norm(grads, norm_type=2.0).double() ** 2)


def log_mlflow_metric(args, name: str, value: float, step: int) -> None:
    """One metric into the active MLflow run (MLflowCallback only forwards the Trainer's own logs)."""
    if mlflow_enabled(args):
        import mlflow

        if mlflow.active_run() is not None:
            mlflow.log_metric(name, value, step=step)


class NonFiniteGuard(TrainerCallback):
    """Skip steps with a non-finite global gradient norm; stop after `max_in_a_row` consecutive ones."""

    def __init__(self, max_in_a_row: int) -> None:
        if max_in_a_row < 1:
            raise ValueError(f"max_nonfinite_steps_in_a_row must be at least 1, got {max_in_a_row}.")
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.skipped_steps: list[int] = []
        self.halted_at_step: int | None = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        # Shards differ per rank: agreeing on the summed squares gives every rank the same global norm.
        grad_norm = math.sqrt(agree_sum(local_grad_norm_squared(model), args.ddp_timeout))
        if math.isfinite(grad_norm):
            self.in_a_row = 0
            return
        for parameter in model.parameters():
            parameter.grad = None
        step = state.global_step + 1  # the step being taken
        self.in_a_row += 1
        self.skipped_steps.append(step)
        if state.is_world_process_zero:
            logger.warning("step %d: gradient norm is %s: update skipped (%d in a row, %d in total; stop after %d)",
                           step, grad_norm, self.in_a_row, len(self.skipped_steps), self.max_in_a_row)
            log_mlflow_metric(args, "nonfinite_steps_skipped", len(self.skipped_steps), step)
        if self.in_a_row >= self.max_in_a_row:
            self.halted_at_step = step
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        if self.halted_at_step is None:
            return
        # Every rank stops here together. Rank 0 prints the line, and no rank exits before every rank got here
        # (as a refusal: refusal_exit), so torchrun stops none of them first -- rank 0 before its line was out.
        with refusing_together(NONFINITE_STOP_EXIT_CODE):
            if state.is_world_process_zero:
                print(f"error: stopped at step {self.halted_at_step}: {self.max_in_a_row} optimizer steps in a row had "
                      f"a non-finite gradient norm (skipped steps: {self.skipped_steps}). {args.output_dir}/checkpoint-"
                      f"{self.halted_at_step} holds the last finite weights. Look for the cause (learning_rate too "
                      "high, bf16 overflow, a corrupt row), fix it and resume; max_nonfinite_steps_in_a_row sets the "
                      "patience.", file=sys.stderr, flush=True)
        raise SystemExit(NONFINITE_STOP_EXIT_CODE)
