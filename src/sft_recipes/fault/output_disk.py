"""The disk under output_dir: writable from the start, room for each checkpoint, a full disk said in one line.

- A read-only (or otherwise unwritable) output_dir used to surface after the whole data pass, as
  an `OSError: [Errno 30]` traceback on every rank when data_report.json was written.
  `refuse_unwritable_output_dir` tries a write at start, before any data or model work.
- A disk that fills during a checkpoint save failed with whatever the writer met first: `No space
  left on device`, or torch's zip writer's `unexpected pos 704 vs 598`, which never names the
  disk. `saved_or_refused` agrees over the ranks whether any rank's save met a full disk and, if
  so, refuses on every rank with the disk, its free space and the checkpoint's size. The
  half-written checkpoint has no completion marker: the next start sets it aside
  (`fault.resume.protect_output_dir`), the earlier checkpoints stay.
- Before each save, `check_room_before_save` compares the free space (the least over the ranks:
  node-local disks differ) with the size of the newest complete checkpoint: it warns when fewer
  than two more fit, and refuses when not one does, before a byte is written.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from sft_recipes.errors import RecipeError
from sft_recipes.fault.agreement import agree_max, agree_min
from sft_recipes.fault.checkpoints import newest_complete_checkpoint

logger = logging.getLogger(__name__)

# Besides ENOSPC: torch's zip writer (torch.save) reports a short write as a position mismatch.
DISK_FULL_WORDS = ("No space left on device", "unexpected pos")


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def mount_point(path: Path) -> Path:
    """The mount point of the disk `path` (or its nearest existing parent) is on."""
    path = _existing_parent(path).resolve()
    while not os.path.ismount(path):
        path = path.parent
    return path


def gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**27 else f"{size / 2**20:.1f} MiB"


def refuse_unwritable_output_dir(output_dir: str | os.PathLike) -> None:
    """RecipeError unless output_dir is a folder (or none yet) that this process can create and write a file in."""
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise RecipeError(f"output_dir {path} is a file, not a folder: give the folder the run writes its checkpoints "
                          "and model into (--output_dir DIR, e.g. outputs/NAME).")
    probe = path / f".write-probe-{uuid.uuid4().hex}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise RecipeError(
            f"output_dir {path} is not writable ({error.strerror}, on the disk mounted at {mount_point(path)}): the "
            "run writes its data report, checkpoints and model there. Give an output_dir on a writable disk "
            "(--output_dir DIR); to continue from its checkpoints, copy them there first."
        ) from None


def directory_size(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def check_room_before_save(output_dir: str | os.PathLike, step: int, timeout_seconds: int) -> None:
    """Warn when fewer than two checkpoints like the newest complete one fit on the disk; RecipeError when
    not one does. Collective: every rank calls it before the save of `step`, and all decide the same."""
    newest = newest_complete_checkpoint(output_dir)
    size = agree_max(directory_size(newest.path) if newest else 0, timeout_seconds)
    free = agree_min(shutil.disk_usage(_existing_parent(Path(output_dir))).free, timeout_seconds)
    if not size or free >= 2 * size:
        return
    disk = mount_point(Path(output_dir))
    if free < size:
        raise RecipeError(
            f"No room for checkpoint-{step}: the disk mounted at {disk} (output_dir {output_dir}) has {gib(free)} "
            f"free, the newest checkpoint ({newest.path.name}) takes {gib(size)}. Free space there (or lower "
            f"save_total_limit) and resume: the run continues from {newest.path.name}."
        )
    logger.warning("[checkpoint] the disk mounted at %s has %s free: room for one more checkpoint of %s (like %s), "
                   "not two; free space or lower save_total_limit", disk, gib(free), gib(size), newest.path.name)


def disk_full(error: BaseException) -> bool:
    """Whether `error`, or one it wraps (a cause, a context, a distributed checkpoint's per-rank failures), is a full disk."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return True
        if any(words in str(current) for words in DISK_FULL_WORDS):
            return True
        pending += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)  # torch.distributed.checkpoint.CheckpointException
        if isinstance(failures, dict):
            pending += [failure for failure in failures.values() if isinstance(failure, BaseException)]
    return False


def saved_or_refused(save: Callable[[], None], checkpoint_dir: Path, timeout_seconds: int) -> None:
    """Run this rank's part of a checkpoint save; when any rank's part met a full disk, RecipeError on every rank.

    Collective: every rank calls it around the same save. Other failures are raised as they are.
    """
    failed = None
    try:
        save()
    except BaseException as error:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if isinstance(error, (KeyboardInterrupt, SystemExit)) or not disk_full(error):
            raise
        failed = error
    if not agree_max(int(failed is not None), timeout_seconds):
        return
    output_dir = checkpoint_dir.parent
    newest = newest_complete_checkpoint(output_dir)
    written = directory_size(checkpoint_dir) if checkpoint_dir.exists() else 0
    size = (f"the newest complete checkpoint ({newest.path.name}) takes {gib(directory_size(newest.path))}"
            if newest else f"{gib(written)} of it were written before the disk filled")
    free = agree_min(shutil.disk_usage(_existing_parent(output_dir)).free, timeout_seconds)
    raise RecipeError(
        f"The disk filled while saving {checkpoint_dir.name}: the disk mounted at {mount_point(output_dir)} (output_dir "
        f"{output_dir}) has {gib(free)} free, {size}. Free space there (or lower save_total_limit) and resume: the "
        f"half-written {checkpoint_dir.name} is set aside at the next start"
        + (f", and the run continues from {newest.path.name}." if newest else ".")
    ) from failed
