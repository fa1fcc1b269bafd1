"""Test-only launcher: scripts/sft.py with faults injected, chosen by environment variables.

    accelerate launch ... tests/fault_injection.py RECIPE [--key value ...]

Each variable names a rank and the optimizer step (1-based, the step being taken) it acts on:
  FAULT_SLOW_STEP_SECONDS=0.3     every rank sleeps this long per micro-batch (to signal mid-run)
  FAULT_KILL_IN_SAVE=1:4          rank 1 SIGKILLs itself in the save of checkpoint-4, after the model
                                  and optimizer shards are written and before its RNG state
  FAULT_HANG_AT=1:3               rank 1 SIGSTOPs itself at the start of step 3 (a hung, not dead, rank)
  FAULT_NAN_AT=1:3,5,6            rank 1's loss is NaN at steps 3, 5 and 6
  FAULT_END_TOGETHER=1            the trainer gets EndOfDataTogetherMixin; every rank prints
                                  "BATCHES rank=R step=S n=N" for each optimizer step
Not a fault, a probe:
  PROBE_LOCAL_SHARDS=DIR          after training, every rank saves what it holds of each parameter (its local
                                  shard, mesh shape and placements) to DIR/rank<R>.pt
  PROBE_MICRO_GRADS=DIR           after each micro-batch of the first optimizer step, every rank appends to
                                  DIR/rank<R>.jsonl the gradient elements it holds: sharded (the DTensor
                                  grads' local shards) and unsharded (what FSDP2 keeps between micro-batches)
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
from pathlib import Path

import transformers
import trl

REPO_ROOT = Path(__file__).resolve().parents[1]
RANK = int(os.environ.get("RANK", "0"))


def _target(name: str) -> tuple[int, set[int]] | None:
    """'rank:step[,step...]' from the environment."""
    value = os.environ.get(name)
    if not value:
        return None
    rank, steps = value.split(":")
    return int(rank), {int(step) for step in steps.split(",")}


def _here(target: tuple[int, set[int]] | None, step: int) -> bool:
    return target is not None and target[0] == RANK and step in target[1]


def held_gradient_elements(model) -> dict[str, int]:
    """Gradient elements this rank holds now: sharded DTensor grads, and the unsharded grads FSDP2 keeps for
    accumulation (torch `FSDPParam`: `_unsharded_param.grad`, or `unsharded_accumulated_grad` in the reduce dtype)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    trainable = [param for param in model.parameters() if param.requires_grad]
    sharded = sum(param.grad.to_local().numel() for param in trainable if isinstance(param.grad, DTensor))
    unsharded = 0
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for fsdp_param in group.fsdp_params if group is not None else []:
            kept = getattr(fsdp_param, "_unsharded_param", None)
            for grad in (kept.grad if kept is not None else None, fsdp_param.unsharded_accumulated_grad):
                unsharded += grad.numel() if grad is not None else 0
    return {"sharded": sharded, "unsharded": unsharded, "shard": sum(param.to_local().numel() for param in trainable),
            "full": sum(param.numel() for param in trainable)}


def install_faults() -> None:
    trainer_cls = transformers.Trainer
    slow = float(os.environ.get("FAULT_SLOW_STEP_SECONDS", "0"))
    hang, nan, kill_in_save = _target("FAULT_HANG_AT"), _target("FAULT_NAN_AT"), _target("FAULT_KILL_IN_SAVE")

    original_training_step = trainer_cls.training_step

    grads_dir = os.environ.get("PROBE_MICRO_GRADS")

    def training_step(self, model, inputs, num_items_in_batch=None):
        if slow:
            time.sleep(slow)
        if _here(hang, self.state.global_step + 1):
            os.kill(os.getpid(), signal.SIGSTOP)
        loss = original_training_step(self, model, inputs, num_items_in_batch)
        if grads_dir and self.state.global_step == 0:
            Path(grads_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(grads_dir) / f"rank{RANK}.jsonl", "a") as out:
                out.write(json.dumps(held_gradient_elements(model)) + "\n")
        return loss

    original_compute_loss = trl.SFTTrainer.compute_loss  # SFTTrainer computes its loss itself

    def compute_loss(self, model, inputs, *args, **kwargs):
        result = original_compute_loss(self, model, inputs, *args, **kwargs)
        if _here(nan, self.state.global_step + 1):
            if isinstance(result, tuple):
                return (result[0] * float("nan"), *result[1:])
            return result * float("nan")
        return result

    original_save_rng_state = trainer_cls._save_rng_state

    def save_rng_state(self, output_dir):
        if _here(kill_in_save, self.state.global_step):
            os.kill(os.getpid(), signal.SIGKILL)
        return original_save_rng_state(self, output_dir)

    original_train = trainer_cls.train
    probe_dir = os.environ.get("PROBE_LOCAL_SHARDS")

    def train(self, *args, **kwargs):
        result = original_train(self, *args, **kwargs)
        if probe_dir:
            import torch

            held = {name: {"local": param.to_local().detach().clone(), "mesh": tuple(param.device_mesh.shape),
                           "placements": [repr(p) for p in param.placements]}
                    for name, param in self.model.named_parameters()}
            Path(probe_dir).mkdir(parents=True, exist_ok=True)
            torch.save(held, Path(probe_dir) / f"rank{RANK}.pt")
        return result

    trainer_cls.train = train
    trainer_cls.training_step = training_step
    trl.SFTTrainer.compute_loss = compute_loss
    trainer_cls._save_rng_state = save_rng_state

    if os.environ.get("FAULT_END_TOGETHER"):  # report what RecipeSFTTrainer's EndOfDataTogetherMixin takes
        # Patched on the class, as above: a run forked by the warm launcher has sft_recipes.run imported already, with
        # its own reference to the class
        from sft_recipes.trainer import RecipeSFTTrainer

        original_get_batch_samples = RecipeSFTTrainer.get_batch_samples

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            batches, items = original_get_batch_samples(self, epoch_iterator, num_batches, device)
            print(f"BATCHES rank={RANK} step={self.state.global_step + 1} n={len(batches)}", flush=True)
            return batches, items

        RecipeSFTTrainer.get_batch_samples = get_batch_samples


if __name__ == "__main__":
    install_faults()
    sys.argv = [str(REPO_ROOT / "scripts" / "sft.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
