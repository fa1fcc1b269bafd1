"""The disk under output_dir: a read-only one refused at start, a full one refused before or during a save.

Real disks, not mocks: small tmpfs mounts (this needs root, as the test machines run; elsewhere the
tests are skipped and say why).
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from conftest import TINY_LLAMA_RECIPE, bin_path, launch_sft, run_command
from sft_recipes.errors import RecipeError
from sft_recipes.fault.checkpoints import COMPLETION_MARKER
from sft_recipes.fault.output_disk import check_room_before_save, disk_full, refuse_unwritable_output_dir


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 1 MiB mounted at tmp_path/disk (remountable read-only); unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()

    def mount(*options: str) -> None:
        subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(("size=1m", *options)), "tmpfs", str(disk)], check=True,
                       capture_output=True)

    try:
        mount()
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"mounting a tmpfs needs root: {error}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def remount_read_only(disk) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)


def complete_checkpoint(output_dir, step: int, size: int):
    checkpoint = output_dir / f"checkpoint-{step}"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.bin").write_bytes(b"\0" * size)
    (checkpoint / COMPLETION_MARKER).write_text(json.dumps({"step": step, "recipe_fingerprint": "f", "completed_at": step}))
    return checkpoint


def test_a_read_only_output_dir_is_refused_naming_the_disk(small_disk):
    earlier = complete_checkpoint(small_disk / "out", 2, 1000)
    remount_read_only(small_disk)
    with pytest.raises(RecipeError) as error:
        refuse_unwritable_output_dir(small_disk / "out")
    assert str(error.value) == (
        f"output_dir {small_disk / 'out'} is not writable (Read-only file system, on the disk mounted at {small_disk}): "
        "the run writes its data report, checkpoints and model there. Give an output_dir on a writable disk "
        "(--output_dir DIR); to continue from its checkpoints, copy them there first.")
    with pytest.raises(RecipeError, match=r"output_dir .*/out/new is not writable \(Read-only file system"):
        refuse_unwritable_output_dir(small_disk / "out" / "new")  # one it would have to create
    assert (earlier / "model.bin").stat().st_size == 1000


def test_an_output_dir_that_is_a_file_is_refused_as_one(tmp_path):
    (tmp_path / "README.md").write_text("notes")
    with pytest.raises(RecipeError) as error:
        refuse_unwritable_output_dir(tmp_path / "README.md")
    assert str(error.value) == (
        f"output_dir {tmp_path / 'README.md'} is a file, not a folder: give the folder the run writes its checkpoints "
        "and model into (--output_dir DIR, e.g. outputs/NAME).")
    assert (tmp_path / "README.md").read_text() == "notes"


def test_the_training_script_refuses_a_read_only_output_dir_before_reading_data(small_disk):
    complete_checkpoint(small_disk / "out", 2, 1000)
    remount_read_only(small_disk)
    result = run_command([bin_path("python"), "scripts/sft.py", str(TINY_LLAMA_RECIPE), "--output_dir",
                          str(small_disk / "out"), "--max_steps", "1"])
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: output_dir {small_disk / 'out'} is not writable (Read-only file system, on the disk "
                      f"mounted at {small_disk}): the run writes its data report, checkpoints and model there. Give an "
                      "output_dir on a writable disk (--output_dir DIR); to continue from its checkpoints, copy them "
                      "there first."]
    assert "[data]" not in result.stderr and "Traceback" not in result.stderr
    assert sorted(path.name for path in (small_disk / "out").iterdir()) == ["checkpoint-2"]


def test_before_a_save_too_little_room_warns_then_refuses(small_disk, caplog):
    output_dir = small_disk / "out"
    check_room_before_save(output_dir, 1, 60)  # no checkpoint yet: nothing to measure by
    complete_checkpoint(output_dir, 1, 300_000)  # 1 MiB disk: room for two more of these, then one
    with caplog.at_level("WARNING", logger="sft_recipes.fault.output_disk"):
        check_room_before_save(output_dir, 2, 60)
        assert not caplog.records
        complete_checkpoint(output_dir, 2, 300_000)
        check_room_before_save(output_dir, 3, 60)
    assert [record.getMessage() for record in caplog.records] == [
        f"[checkpoint] the disk mounted at {small_disk} has 0.4 MiB free: room for one more checkpoint of 0.3 MiB (like "
        "checkpoint-2), not two; free space or lower save_total_limit"]
    complete_checkpoint(output_dir, 3, 300_000)
    with pytest.raises(RecipeError) as error:
        check_room_before_save(output_dir, 4, 60)
    assert str(error.value) == (
        f"No room for checkpoint-4: the disk mounted at {small_disk} (output_dir {output_dir}) has 0.1 MiB free, the "
        "newest checkpoint (checkpoint-3) takes 0.3 MiB. Free space there (or lower save_total_limit) and resume: the "
        "run continues from checkpoint-3.")


def test_a_full_disk_is_recognised_through_what_wraps_it():
    assert disk_full(OSError(28, "No space left on device"))
    assert disk_full(RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598"))
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = OSError(28, "No space left on device")
    assert disk_full(wrapped)
    try:
        raise OSError(28, "No space left on device")
    except OSError as error:
        dcp = CheckpointException("write", {1: _wrap_exception(error)})  # what every rank of a DCP save raises
    assert disk_full(dcp) and not isinstance(dcp, Exception)  # a BaseException: `except Exception` misses it
    assert not disk_full(OSError(13, "Permission denied")) and not disk_full(ValueError("shape mismatch"))


@pytest.mark.fsdp
def test_a_disk_that_fills_during_a_save_ends_in_one_line_and_exit_2_on_every_rank(small_disk):
    """The tiny Llama's first checkpoint (~2 MB: DCP shards, optimizer, RNG states) cannot fit on a 1 MiB disk."""
    output_dir = small_disk / "out"
    result = launch_sft(TINY_LLAMA_RECIPE, "--output_dir", str(output_dir), "--max_steps", "2", "--save_steps", "1",
                        "--report_to", "none", check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-4000:]
    assert re.fullmatch(
        rf"error: The disk filled while saving checkpoint-1: the disk mounted at {re.escape(str(small_disk))} \(output_dir "
        rf"{re.escape(str(output_dir))}\) has \d+\.\d MiB free, \d+\.\d MiB of it were written before the disk filled\. "
        r"Free space there \(or lower save_total_limit\) and resume: the half-written checkpoint-1 is set aside at the "
        r"next start\.", errors[0]), errors[0]
    assert re.findall(r"exitcode  : (-?\d+)", result.stderr) == ["2", "2"]
    assert not (output_dir / "checkpoint-1" / COMPLETION_MARKER).exists()
