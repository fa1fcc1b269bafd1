"""Resume on another world size: the rows of every optimizer step, the packed-stream layouts, the refusals.

The data-order test drives accelerate's own `prepare_data_loader` (seedable sampler, BatchSamplerShard,
skip_first_batches), as the Trainer does, for each rank of 1, 2 and 4 processes.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from types import SimpleNamespace

import pytest
import torch
from accelerate.data_loader import prepare_data_loader, skip_first_batches
from torch.utils.data import DataLoader, RandomSampler

from conftest import TINY_LLAMA_RECIPE, assert_resume_reproduces, launch_sft, read_summary
from sft_recipes.errors import RecipeError
from sft_recipes.fault.checkpoints import COMPLETION_MARKER, recipe_fingerprint, training_layout, write_marker
from sft_recipes.fault.world_size import (
    READERS_KEY,
    reader_layouts,
    readers_refusal,
    refuse_another_training_layout,
    whole_global_batches,
)
from sft_recipes.reporting.export_check import ExportCheck
from sft_recipes.reporting.summary import RunSummaryCallback

ROWS, MICRO, GLOBAL = 50, 2, 8  # 50 rows: 6 whole global batches an epoch, 2 rows left over


def layout(world_size: int, workers: int = 0) -> SimpleNamespace:
    """Training arguments of a run with the global batch GLOBAL on `world_size` processes."""
    return SimpleNamespace(per_device_train_batch_size=MICRO, world_size=world_size,
                           gradient_accumulation_steps=GLOBAL // (MICRO * world_size), dataloader_num_workers=workers,
                           sequence_parallel_size=1)


def rows_per_step(world_size: int, epoch: int, skip_steps: int = 0) -> list[list[int]]:
    """The rows each optimizer step trains on, gathered over the ranks, as the Trainer's dataloader serves them."""
    args, rank_batches = layout(world_size), []
    for rank in range(world_size):
        torch.manual_seed(0)  # the Trainer's set_seed(seed): the same on every rank
        sampler = whole_global_batches(RandomSampler(range(ROWS)), args)
        loader = prepare_data_loader(DataLoader(range(ROWS), batch_size=MICRO, sampler=sampler),
                                     num_processes=world_size, process_index=rank, put_on_device=False,
                                     use_seedable_sampler=True)
        loader.set_epoch(epoch)
        if skip_steps:  # as a resume does: global_step x accumulation micro-batches on each rank
            loader = skip_first_batches(loader, skip_steps * args.gradient_accumulation_steps)
        rank_batches.append([batch.tolist() for batch in loader])
    accumulation = args.gradient_accumulation_steps
    steps = len(rank_batches[0]) // accumulation
    return [sorted(row for batches in rank_batches for batch in batches[step * accumulation:(step + 1) * accumulation]
                   for row in batch) for step in range(steps)]


def test_every_step_trains_the_same_rows_on_any_world_size_and_after_a_resume():
    for epoch in (0, 1):
        one = rows_per_step(1, epoch)
        assert len(one) == ROWS // GLOBAL and all(len(set(step)) == GLOBAL for step in one)
        assert len({row for step in one for row in step}) == ROWS // GLOBAL * GLOBAL  # no row twice in a pass
        assert rows_per_step(2, epoch) == one and rows_per_step(4, epoch) == one
        assert rows_per_step(2, epoch, skip_steps=3) == one[3:] == rows_per_step(4, epoch, skip_steps=3)
    assert rows_per_step(1, 0) != rows_per_step(1, 1)  # each epoch its own permutation


def test_without_whole_global_batches_the_epoch_tail_depends_on_the_world_size():
    """accelerate pads the last step of a pass per rank by wrapping around: on 2 processes the first rows twice."""
    def rows_of_the_pass(world_size):
        rows = []
        for rank in range(world_size):
            torch.manual_seed(0)
            loader = prepare_data_loader(DataLoader(range(ROWS), batch_size=MICRO, sampler=RandomSampler(range(ROWS))),
                                         num_processes=world_size, process_index=rank, put_on_device=False,
                                         use_seedable_sampler=True)
            rows.append([row for batch in loader for row in batch.tolist()])
        return rows
    (one,), two = rows_of_the_pass(1), rows_of_the_pass(2)
    assert sorted(one) == list(range(ROWS))
    assert sorted(two[0] + two[1]) == sorted(one + one[:MICRO])


def test_fewer_rows_than_one_global_batch_is_refused():
    with pytest.raises(RecipeError, match="the train set has 5 rows, fewer than one global batch of 8 sequences"):
        whole_global_batches(RandomSampler(range(5)), layout(2))


def test_the_refusal_names_every_layout_with_the_same_number_of_readers():
    assert reader_layouts(4) == "1 x 4, 2 x 2, 4 x 1"
    message = readers_refusal({READERS_KEY: 4}, {READERS_KEY: 2}, "checkpoint-6")
    assert message.startswith("checkpoint-6 was written by 4 packed-stream readers (groups x dataloader workers; a "
                              "group is one process, or sequence_parallel_size processes), "
                              "this run has 2.")
    assert "Resume with groups x max(1, dataloader_num_workers) = 4, i.e. 1 x 4, 2 x 2, 4 x 1" in message
    assert readers_refusal({READERS_KEY: 4}, {READERS_KEY: 4}, "checkpoint-6") is None
    assert readers_refusal({}, {}, "checkpoint-6") is None  # map-style data: no readers


def marked_checkpoint(tmp_path, recipe_identity: dict, written_on: SimpleNamespace) -> str:
    path = tmp_path / "checkpoint-6"
    path.mkdir()
    write_marker(path, 6, recipe_fingerprint(recipe_identity), recipe_identity, training_layout(written_on))
    return str(path)


def test_a_resume_keeps_the_global_batch_whatever_the_world_size(tmp_path):
    checkpoint = marked_checkpoint(tmp_path, {"global_batch_size": GLOBAL}, layout(2))
    for world_size in (1, 2, 4):  # accumulation 4, 2, 1: the same global batch
        refuse_another_training_layout(checkpoint, layout(world_size))
    fixed_accumulation = SimpleNamespace(per_device_train_batch_size=MICRO, world_size=1, gradient_accumulation_steps=2,
                                         dataloader_num_workers=0, sequence_parallel_size=1)
    with pytest.raises(RecipeError) as error:
        refuse_another_training_layout(checkpoint, fixed_accumulation)
    assert str(error.value).endswith(
        "was trained with a global batch of 8 sequences per optimizer step on 2 process(es); here it would be 4 (2 per "
        "device x 1 processes x 2 accumulation steps), another training. Set global_batch_size: 8 in the recipe (and "
        "drop gradient_accumulation_steps) so accumulation follows the world size, or resume on 2 process(es)")


def test_a_packed_stream_resumes_on_an_equivalent_layout_only(tmp_path):
    checkpoint = marked_checkpoint(tmp_path, {READERS_KEY: 4}, layout(2, workers=2))
    refuse_another_training_layout(checkpoint, layout(4))  # 4 processes, each its one reader in the main process
    with pytest.raises(RecipeError, match=r"written by 4 packed-stream readers .* this run has 2\..* 1 x 4, 2 x 2, 4 x 1"):
        refuse_another_training_layout(checkpoint, layout(2))


def test_the_closing_line_says_when_a_resume_changed_the_world_size(tmp_path):
    summary = RunSummaryCallback()
    summary.world_size, summary.world_size_at_checkpoint = 1, 2
    report = summary.finish(3.0, tmp_path, ExportCheck("skipped"), "out/checkpoint-2", "FSDP2 over 1 process(es) on cpu")
    assert (report["world_size"], report["world_size_at_checkpoint"]) == (1, 2)
    assert f"final loss=n/a, resumed on 1 process(es) from 2 | checkpoint: {tmp_path}" in summary.closing_line(report)
    summary.world_size_at_checkpoint = 1
    closing = summary.closing_line(summary.finish(3.0, tmp_path, ExportCheck("skipped"), None, ""))
    assert "final loss=n/a | checkpoint" in closing


# ── Real runs: the tiny Llama twin with a fixed global batch, resumed on another number of processes ──────────
STEPS, RESUME_AT = 4, 2


@pytest.fixture(scope="module")
def elastic_runs(tmp_path_factory):
    """1 process uninterrupted (the reference); 2 processes to step 2 resumed on 1; the reference's step 2 on 2."""
    root = tmp_path_factory.mktemp("world_size")
    common = ("--save_steps", str(RESUME_AT), "--global_batch_size", "16")  # accumulation derived per world size
    quiet = ("--report_to", "none")
    launch_sft(TINY_LLAMA_RECIPE, *common, *quiet, "--max_steps", str(STEPS), "--output_dir", str(root / "one"), nproc=1)
    launch_sft(TINY_LLAMA_RECIPE, *common, *quiet, "--max_steps", str(RESUME_AT), "--output_dir", str(root / "two_then_one"),
               nproc=2)
    store = root / "mlflow.db"
    launch_sft(TINY_LLAMA_RECIPE, *common, "--report_to", "mlflow", "--max_steps", str(STEPS), "--output_dir",
               str(root / "two_then_one"), nproc=1, env={"MLFLOW_TRACKING_URI": f"sqlite:///{store}"})
    shutil.copytree(root / "one" / f"checkpoint-{RESUME_AT}", root / "one_then_two" / f"checkpoint-{RESUME_AT}")
    launch_sft(TINY_LLAMA_RECIPE, *common, *quiet, "--max_steps", str(STEPS), "--output_dir", str(root / "one_then_two"),
               nproc=2)
    return root, store


@pytest.mark.fsdp
def test_the_steps_before_the_resume_are_the_same_on_one_and_two_processes(elastic_runs):
    """Step s trains on the same rows on any world size: the 2-process run logged the 1-process run's losses."""
    root, _ = elastic_runs
    checkpoint = root / "two_then_one" / f"checkpoint-{RESUME_AT}"
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    two = {str(entry["step"]): entry["loss"] for entry in history if "loss" in entry}
    one = read_summary(root / "one")["losses"]
    assert list(two) == ["1", "2"]
    for step, loss in two.items():
        assert loss == pytest.approx(one[step], abs=1e-4), step
    marker = json.loads((checkpoint / COMPLETION_MARKER).read_text())
    assert (marker["world_size"], marker["dataloader_num_workers"], marker["global_batch_sequences"]) == (2, 0, 16)


@pytest.mark.fsdp
@pytest.mark.parametrize("resumed, world_sizes", [("two_then_one", (2, 1)), ("one_then_two", (1, 2))])
def test_a_resume_on_another_world_size_reproduces_the_uninterrupted_losses(elastic_runs, resumed, world_sizes):
    root, _ = elastic_runs
    assert_resume_reproduces(root / "one", root / resumed, RESUME_AT, atol=1e-4)
    summary = read_summary(root / resumed)
    assert (summary["world_size_at_checkpoint"], summary["world_size"]) == world_sizes


@pytest.mark.fsdp
def test_mlflow_shows_the_world_size_change(elastic_runs):
    _, store = elastic_runs
    tags = dict(sqlite3.connect(store).execute("select key, value from tags"))
    assert (tags["world_size"], tags["world_size_at_checkpoint"]) == ("1", "2")


# ── Packed streams: every layout offered for a reader count trains the same blocks at every step ─────────────

class ReaderRows(torch.utils.data.IterableDataset):
    """One rank's packed-stream readers as the run cuts them (`RankLocalBlockStream.reader_shard`): row ids."""

    def __init__(self, rank: int, ranks: int):
        from datasets import Dataset
        from sft_recipes.data.blocks import RankLocalBlockStream
        rows = Dataset.from_list([{"messages": str(i)} for i in range(64)])
        self.stream = RankLocalBlockStream(rows, SimpleNamespace(pad_token_id=0), 8, rank=rank, world_size=ranks)

    def __iter__(self):  # `.iter()`, as the stream reads it: `__iter__` would split the shard again among workers
        return (int(row) for batch in self.stream.reader_shard().iter(batch_size=8) for row in batch["messages"])


def blocks_per_step(ranks: int, workers: int, global_batch: int, micro: int, steps: int) -> list[list[int]]:
    """What each optimizer step takes from the readers, gathered over the ranks, through torch's DataLoader."""
    accumulation = global_batch // (micro * ranks)
    per_rank = []
    for rank in range(ranks):
        loader = iter(DataLoader(ReaderRows(rank, ranks), batch_size=micro, num_workers=workers))
        per_rank.append([next(loader).tolist() for _ in range(steps * accumulation)])
    return [sorted(row for batches in per_rank for batch in batches[step * accumulation:(step + 1) * accumulation]
                   for row in batch) for step in range(steps)]


@pytest.mark.parametrize("micro, global_batch", [(1, 2), (2, 4), (1, 8)])
def test_every_packed_stream_layout_with_the_same_readers_trains_the_same_blocks_each_step(micro, global_batch):
    """4 readers as 1 x 4, 2 x 2, 4 x 1 (processes x dataloader workers; the refusal's list), each where the global
    batch can be made: a resume on any of them skips what the steps before took and goes on with the same blocks.
    (2 x 2 against 1 x 4 used to differ from the second step when a step takes fewer blocks than there are readers:
    the same readers, consumed in another order.)"""
    assert reader_layouts(4) == "1 x 4, 2 x 2, 4 x 1"
    layouts = [(ranks, 4 // ranks) for ranks in (1, 2, 4) if global_batch % (micro * ranks) == 0]
    assert len(layouts) >= 2
    steps = [blocks_per_step(ranks, workers, global_batch, micro, steps=4) for ranks, workers in layouts]
    assert all(layout_steps == steps[0] for layout_steps in steps), layouts
    assert len({row for step in steps[0] for row in step}) == 4 * global_batch  # no row twice
