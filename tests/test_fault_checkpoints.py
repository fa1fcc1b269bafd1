"""Which checkpoints a run may resume from, rotate, or must leave alone (no training: folders and markers)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import sft_recipes.fault.checkpoints as checkpoints
from conftest import REPO_ROOT, TINY_LLAMA_RECIPE
from sft_recipes.config import RecipeError, load_recipe
from sft_recipes.fault.checkpoints import COMPLETION_MARKER, recipe_fingerprint, rotate_checkpoints, write_marker
from sft_recipes.fault.resume import (
    nothing_left_to_train, protect_output_dir, recipe_identity, resolve_resume_checkpoint,
)


def tiny_recipe(*overrides: str):
    return load_recipe(TINY_LLAMA_RECIPE, list(overrides))


def args_for(output_dir, resume="auto", overwrite=False):
    return SimpleNamespace(output_dir=str(output_dir), resume_from_checkpoint=resume, overwrite_output_dir=overwrite,
                           process_index=0)


def make_checkpoint(output_dir, step, identity=None, completed_at=None, monkeypatch=None):
    """A checkpoint folder; with `identity`, marked complete at `completed_at` as the callback marks it."""
    path = output_dir / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text("{}")
    if identity is not None:
        monkeypatch.setattr(checkpoints.time, "time", lambda: completed_at)
        write_marker(path, step, recipe_fingerprint(identity), identity)
    return path


def test_a_checkpoint_is_said_once_when_complete_and_accelerates_lines_are_quieted(tmp_path, caplog):
    """accelerate 1.15 said each FSDP checkpoint in four INFO lines, before any was complete."""
    import logging

    from sft_recipes.fault.checkpoints import CheckpointCompletionCallback
    from sft_recipes.reporting.console import ACCELERATE_FSDP_LOGGER, one_voice

    recipe = tiny_recipe("--output_dir", str(tmp_path))
    (tmp_path / "checkpoint-4").mkdir()
    callback = CheckpointCompletionCallback(recipe_identity(recipe))
    with caplog.at_level(logging.INFO, logger="sft_recipes.fault.checkpoints"):
        callback.on_save(recipe.training, SimpleNamespace(is_world_process_zero=True, global_step=4), None)
    assert (tmp_path / "checkpoint-4" / COMPLETION_MARKER).is_file()
    assert [record.getMessage() for record in caplog.records] == [
        f"{tmp_path / 'checkpoint-4'} complete: every rank wrote its part (FSDP 1 x 1 (flat) over 1 process)"]
    accelerate_fsdp = logging.getLogger(ACCELERATE_FSDP_LOGGER)
    level = accelerate_fsdp.level
    try:
        accelerate_fsdp.setLevel(logging.INFO)
        one_voice(rank=0)
        assert not accelerate_fsdp.isEnabledFor(logging.INFO) and accelerate_fsdp.isEnabledFor(logging.WARNING)
    finally:
        accelerate_fsdp.setLevel(level)


def test_marker_holds_step_recipe_and_time_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    identity = recipe_identity(tiny_recipe())
    path = make_checkpoint(tmp_path, 4, identity, 123.0, monkeypatch)
    marker = json.loads((path / COMPLETION_MARKER).read_text())
    assert marker["step"] == 4 and marker["completed_at"] == 123.0
    assert marker["recipe"]["learning_rate"] == 0.003 and "output_dir" not in marker["recipe"]
    assert sorted(p.name for p in path.iterdir()) == [COMPLETION_MARKER, "trainer_state.json"]


def test_auto_resumes_from_the_last_completed_checkpoint_and_skips_unfinished_ones(tmp_path, monkeypatch):
    identity = recipe_identity(tiny_recipe())
    make_checkpoint(tmp_path, 4, identity, 100.0, monkeypatch)
    make_checkpoint(tmp_path, 2, identity, 200.0, monkeypatch)  # completed later: a run resumed from 2 wrote it
    make_checkpoint(tmp_path, 6)  # the save did not finish
    assert resolve_resume_checkpoint(args_for(tmp_path)) == str(tmp_path / "checkpoint-2")


def test_auto_starts_fresh_without_a_complete_checkpoint(tmp_path):
    make_checkpoint(tmp_path, 6)
    assert resolve_resume_checkpoint(args_for(tmp_path)) is None
    assert resolve_resume_checkpoint(args_for(tmp_path / "missing")) is None


def test_an_explicit_checkpoint_is_used_as_given_and_a_wrong_path_is_an_error(tmp_path):
    unfinished = make_checkpoint(tmp_path, 6)
    assert resolve_resume_checkpoint(args_for(tmp_path, resume=str(unfinished))) == str(unfinished)
    with pytest.raises(ValueError, match="is not a checkpoint directory. Use 'auto'"):
        resolve_resume_checkpoint(args_for(tmp_path, resume=str(tmp_path / "checkpoint-9")))
    # A folder that is no checkpoint: was transformers' "Can't find a valid checkpoint" traceback after the model loaded.
    make_checkpoint(tmp_path, 2)
    with pytest.raises(ValueError) as error:  # the output_dir itself, not one of its checkpoints
        resolve_resume_checkpoint(args_for(tmp_path, resume=str(tmp_path)))
    assert str(error.value) == (
        f"resume_from_checkpoint={str(tmp_path)!r} holds no checkpoint (no trainer_state.json); it holds checkpoint-2, "
        f"checkpoint-6: pass one of them. Use 'auto' to take the newest checkpoint in output_dir, or a path like "
        f"{tmp_path}/checkpoint-100.")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty' holds no checkpoint \(no trainer_state.json\)\. Use 'auto'"):
        resolve_resume_checkpoint(args_for(tmp_path, resume=str(tmp_path / "empty")))


def test_the_same_recipe_written_differently_or_resumed_with_other_run_settings_is_the_same(tmp_path):
    base = recipe_fingerprint(recipe_identity(tiny_recipe()))
    assert recipe_fingerprint(recipe_identity(tiny_recipe("--learning_rate", "3e-3"))) == base
    assert recipe_fingerprint(recipe_identity(tiny_recipe("--max_steps", "99", "--save_steps", "7",
                                                          "--output_dir", str(tmp_path)))) == base
    assert recipe_fingerprint(recipe_identity(tiny_recipe("--learning_rate", "1e-3"))) != base


def test_another_recipes_checkpoints_are_refused_with_the_difference(tmp_path, monkeypatch):
    make_checkpoint(tmp_path, 4, recipe_identity(tiny_recipe("--learning_rate", "1e-3")), 100.0, monkeypatch)
    with pytest.raises(ValueError) as error:
        protect_output_dir(tiny_recipe(), args_for(tmp_path))
    message = str(error.value)
    assert "holds checkpoints of another recipe (checkpoint-4): learning_rate: 0.001 there, 0.003 here" in message
    assert "--overwrite_output_dir true" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]
    # A value transformers holds as an enum is shown as the marker stores it, not as the enum's repr
    with pytest.raises(ValueError) as error:
        protect_output_dir(tiny_recipe("--lr_scheduler_type", "cosine"), args_for(tmp_path))
    assert "lr_scheduler_type: 'constant' there, 'cosine' here" in str(error.value)


def test_overwrite_sets_every_checkpoint_aside_and_deletes_nothing(tmp_path, monkeypatch):
    make_checkpoint(tmp_path, 4, recipe_identity(tiny_recipe("--learning_rate", "1e-3")), 100.0, monkeypatch)
    make_checkpoint(tmp_path, 2, recipe_identity(tiny_recipe()), 90.0, monkeypatch)
    moved = protect_output_dir(tiny_recipe(), args_for(tmp_path, overwrite=True))
    assert sorted(p.name for p in moved) == ["checkpoint-2", "checkpoint-4"]
    assert all((p / "trainer_state.json").is_file() for p in moved)
    assert not list(tmp_path.glob("checkpoint-*"))
    assert resolve_resume_checkpoint(args_for(tmp_path)) is None


def test_overwrite_starts_over_on_a_rank_that_still_sees_the_checkpoints(tmp_path, monkeypatch):
    # Rank 1 decides while rank 0 may not have moved anything yet: it must not resume (it then found nothing
    # left to train at --max_steps 2 and exited, and rank 0 died alone in its first barrier).
    make_checkpoint(tmp_path, 6, recipe_identity(tiny_recipe()), 100.0, monkeypatch)
    rank_one = SimpleNamespace(**{**vars(args_for(tmp_path, overwrite=True)), "process_index": 1})
    moved = protect_output_dir(tiny_recipe(), rank_one)
    assert [p.name for p in moved] == ["checkpoint-6"] and (tmp_path / "checkpoint-6").is_dir()  # rank 0 moves
    assert resolve_resume_checkpoint(rank_one) is None


def test_a_finished_export_without_a_checkpoint_is_refused_or_set_aside_never_overwritten(tmp_path, monkeypatch):
    # A user's notes and config, or a run trained without checkpoints: training would overwrite them silently.
    (tmp_path / "README.md").write_text("my precious notes")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "train.log").write_text("an earlier refusal")
    with pytest.raises(RecipeError) as refused:
        protect_output_dir(tiny_recipe(), args_for(tmp_path))
    assert str(refused.value) == (
        f"output_dir {tmp_path} holds README.md, config.json and no checkpoint to resume from: this run would overwrite "
        "them. Use another output_dir, or pass --overwrite_output_dir true to start over here (what a run would "
        "overwrite is moved to a set-aside-<time>/ folder, not deleted).")
    moved = protect_output_dir(tiny_recipe(), args_for(tmp_path, overwrite=True))
    assert [path.name for path in moved] == ["README.md", "config.json"]
    assert moved[0].read_text() == "my precious notes" and moved[0].parent.name.startswith("set-aside-")
    assert sorted(path.name for path in tmp_path.iterdir() if path.is_file()) == ["train.log"]  # appended to


def test_a_run_stopped_before_its_first_checkpoint_is_retried_and_a_finished_one_resumed(tmp_path, monkeypatch):
    for name in ("train.log", "data_report.json"):  # what a run writes before its first checkpoint
        (tmp_path / name).write_text("{}")
    assert protect_output_dir(tiny_recipe(), args_for(tmp_path)) == []
    make_checkpoint(tmp_path, 4, recipe_identity(tiny_recipe()), 100.0, monkeypatch)
    for name in ("config.json", "model.safetensors", "README.md", "run_summary.json"):
        (tmp_path / name).write_text("{}")
    assert protect_output_dir(tiny_recipe(), args_for(tmp_path)) == []  # it resumes (or has nothing left to train)
    assert resolve_resume_checkpoint(args_for(tmp_path)) == str(tmp_path / "checkpoint-4")


def test_unfinished_checkpoints_are_set_aside_and_this_recipes_are_kept(tmp_path, monkeypatch):
    recipe = tiny_recipe()
    make_checkpoint(tmp_path, 2, recipe_identity(recipe), 100.0, monkeypatch)
    make_checkpoint(tmp_path, 4)
    moved = protect_output_dir(recipe, args_for(tmp_path))
    assert [p.relative_to(tmp_path).parts[1] for p in moved] == ["checkpoint-4"]
    assert moved[0].parent.name.startswith("set-aside-") and (moved[0] / "trainer_state.json").is_file()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]


def test_an_explicitly_requested_checkpoint_is_never_set_aside(tmp_path):
    unfinished = make_checkpoint(tmp_path, 4)
    assert protect_output_dir(tiny_recipe(), args_for(tmp_path, resume=str(unfinished))) == []
    assert unfinished.is_dir()


def test_rotation_deletes_only_this_recipes_oldest_complete_checkpoints(tmp_path, monkeypatch):
    identity = recipe_identity(tiny_recipe())
    for step, completed_at in ((6, 300.0), (2, 100.0), (4, 200.0)):
        make_checkpoint(tmp_path, step, identity, completed_at, monkeypatch)
    make_checkpoint(tmp_path, 8)  # unfinished
    make_checkpoint(tmp_path, 10, recipe_identity(tiny_recipe("--learning_rate", "1e-3")), 50.0, monkeypatch)
    deleted = rotate_checkpoints(tmp_path, keep=2, fingerprint=recipe_fingerprint(identity))
    assert deleted == [tmp_path / "checkpoint-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-4", "checkpoint-6",
                                                          "checkpoint-8"]
    assert rotate_checkpoints(tmp_path, keep=None, fingerprint=recipe_fingerprint(identity)) == []


def test_a_packed_stream_resumes_only_with_the_same_readers(tmp_path, monkeypatch):
    qwen = REPO_ROOT / "recipes" / "tiny" / "qwen27b.yaml"
    two_workers = recipe_identity(load_recipe(qwen, []))
    readers = "packed_stream_readers (sequence-parallel groups x dataloader_num_workers)"
    assert two_workers[readers] == 2  # one process here, 2 workers
    make_checkpoint(tmp_path, 4, two_workers, 100.0, monkeypatch)
    with pytest.raises(ValueError) as error:
        protect_output_dir(load_recipe(qwen, ["--dataloader_num_workers", "0"]), args_for(tmp_path))
    assert str(error.value).startswith(f"{tmp_path}/checkpoint-4 was written by 2 packed-stream readers (groups x "
                                       "dataloader workers; a group is one process, or sequence_parallel_size "
                                       "processes), this run has 1.")
    assert "i.e. 1 x 2, 2 x 1 (dataloader_num_workers 0 counts as 1)" in str(error.value)
    assert protect_output_dir(load_recipe(qwen, []), args_for(tmp_path)) == []  # same readers: resumes
    two_processes_one_worker = load_recipe(qwen, ["--dataloader_num_workers", "1"])
    monkeypatch.setattr(type(two_processes_one_worker.training), "world_size", property(lambda self: 2))
    assert protect_output_dir(two_processes_one_worker, args_for(tmp_path)) == []  # 2 x 1 == 1 x 2: resumes


def test_a_checkpoint_at_max_steps_or_at_the_end_of_its_epochs_leaves_nothing_to_train(tmp_path):
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 4, "max_steps": 4, "num_train_epochs": 1}))

    def args(**changes):
        return SimpleNamespace(**{"max_steps": -1, "num_train_epochs": 1.0, **changes})

    assert nothing_left_to_train(str(checkpoint), args(max_steps=4)) == (
        f"{checkpoint} has already trained 4 step(s), reaching max_steps 4: nothing to train, nothing written. To "
        "train further pass a larger --max_steps (e.g. --max_steps 8); to start over in this output_dir pass "
        "--overwrite_output_dir true.")
    assert nothing_left_to_train(str(checkpoint), args(max_steps=3)) is not None  # past it: nothing either
    assert nothing_left_to_train(str(checkpoint), args(max_steps=5)) is None
    assert "reaching num_train_epochs 1 (4 steps)" in nothing_left_to_train(str(checkpoint), args())
    assert nothing_left_to_train(str(checkpoint), args(num_train_epochs=2.0)) is None  # one more epoch to train
    assert nothing_left_to_train(None, args(max_steps=4)) is None  # a fresh run
