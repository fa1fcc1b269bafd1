"""A step's loss is the mean over every supervised token of the global batch, for every architecture.

Two gloo processes, each with its own supervised-token counts, run the Trainer's own step machinery
(`get_batch_samples`' token count, `training_step` per accumulation micro-batch), then average gradients
and logged losses across ranks as FSDP/DDP and the Trainer's logging do. That must equal one process
doing the whole global batch, and both must equal the token-weighted mean computed by hand (1e-5).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from conftest import free_port
from datasets import Dataset
from trl import SFTConfig
from worker_processes import worker_context

from sft_recipes.architectures.registry import prepare_for_packing
from sft_recipes.tiny import AUTO_MODEL_CLASSES, build_tokenizer, tiny_config
from sft_recipes.trainer import RecipeSFTTrainer

FAMILIES = ("llama", "qwen3_5")
IGNORE = -100


def global_micro_batches(packed: bool) -> list[dict[str, torch.Tensor]]:
    """Four micro-batches with different supervised-token counts (1, 7, 3, 12 label positions)."""
    supervised = [1, 7, 3, 12]
    batches = []
    for number, count in enumerate(supervised):
        generator = torch.Generator().manual_seed(number)
        if packed:  # one row of two packed examples, positions restarting at the second
            lengths = [9, 7 + number]
            ids = torch.randint(20, 200, (1, sum(lengths)), generator=generator)
            labels = torch.full_like(ids, IGNORE)
            labels[0, -count:] = ids[0, -count:]
            positions = torch.cat([torch.arange(length) for length in lengths]).unsqueeze(0)
            batches.append({"input_ids": ids, "position_ids": positions, "labels": labels})
        else:  # two right-padded rows
            ids = torch.randint(20, 200, (2, 14), generator=generator)
            attention = torch.ones_like(ids)
            attention[1, 10 - number :] = 0
            labels = torch.full_like(ids, IGNORE)
            labels[0, -count:] = ids[0, -count:]
            labels[1, 2:4] = ids[1, 2:4]
            batches.append({"input_ids": ids, "attention_mask": attention, "labels": labels})
    return batches


def tiny_model(family: str):
    torch.manual_seed(0)
    model = AUTO_MODEL_CLASSES[family].from_config(tiny_config(family), dtype=torch.float32)
    prepare_for_packing(model)
    return model


def step_worker(rank: int, world_size: int, port: int, out_dir: str, tokenizers: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    results = {}
    for family in FAMILIES:
        tokenizer = tokenizers[family]
        for packed in (False, True):
            micro_batches = global_micro_batches(packed)[rank::world_size]  # each rank its own share
            model = tiny_model(family)
            args = SFTConfig(output_dir=out_dir, per_device_train_batch_size=1, use_cpu=True, report_to=[],
                             gradient_accumulation_steps=len(micro_batches), save_strategy="no")
            trainer = RecipeSFTTrainer(model=model, args=args, processing_class=tokenizer,
                                       train_dataset=Dataset.from_list([{"input_ids": [1, 2, 3]}]))
            trainer.current_gradient_accumulation_steps = len(micro_batches)
            # The Trainer's own count: supervised (shifted) labels of every micro-batch, summed over ranks.
            _, num_items = trainer.get_batch_samples(iter(micro_batches), len(micro_batches), torch.device("cpu"))
            logged = sum(trainer.training_step(model, dict(batch), num_items) for batch in micro_batches)
            grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            if world_size > 1:  # FSDP/DDP average the gradients; the Trainer logs the mean of the ranks' losses
                dist.all_reduce(grads)
                dist.all_reduce(logged)
                grads, logged = grads / world_size, logged / world_size
            results[family, packed] = (float(logged), grads, None if num_items is None else int(num_items))
    if rank == 0:
        torch.save(results, os.path.join(out_dir, f"world{world_size}.pt"))


def token_mean_reference(family: str, packed: bool) -> tuple[float, torch.Tensor, int]:
    """Sum of every supervised token's cross-entropy over the global batch / their number, by hand."""
    model = tiny_model(family)
    total, count = 0.0, 0
    for batch in global_micro_batches(packed):
        inputs = {key: value for key, value in batch.items() if key != "labels"}
        logits = model(**inputs).logits[:, :-1]
        targets = batch["labels"][:, 1:]
        total = total + torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE, reduction="sum"
        )
        count += int(targets.ne(IGNORE).sum())
    loss = total / count
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return loss.item(), grads, count


@pytest.mark.fsdp
def test_step_loss_and_gradients_are_the_global_token_mean_across_ranks_and_accumulation(tmp_path):
    tokenizers = {family: build_tokenizer(family, vocab_size=512) for family in FAMILIES}
    context = worker_context()
    workers = [  # one process alone, and two together, at the same time
        context.Process(target=step_worker, args=(rank, world_size, port, str(tmp_path), tokenizers))
        for world_size, port in ((1, free_port()), (2, free_port()))
        for rank in range(world_size)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=600)
    assert [worker.exitcode for worker in workers] == [0, 0, 0]
    one, two = torch.load(tmp_path / "world1.pt"), torch.load(tmp_path / "world2.pt")
    for family in FAMILIES:
        for packed in (False, True):
            loss, grads, count = token_mean_reference(family, packed)
            for world_size, results in ((1, one), (2, two)):
                got_loss, got_grads, got_count = results[family, packed]
                where = f"{family} packed={packed} world_size={world_size}"
                assert got_loss == pytest.approx(loss, abs=1e-5), where
                torch.testing.assert_close(got_grads, grads, atol=1e-5, rtol=1e-4, msg=where)
                assert got_count == count, where
