"""Time spent waiting for data, beside the time a step computes.

transformers fetches a step's micro-batches (`Trainer.get_batch_samples`) before the step begins, so the
steps' own time (`seconds_per_step`, from `on_step_begin` to `on_step_end`) leaves the wait out: a run on
8000 x 8000 images that took 57 s a step read `1.01s/step`. `DataWaitMixin` times every fetch; the closing
line adds the wait per step when it is a tenth of the compute or more, and a warning says so when the wait
is the larger part.
"""

from __future__ import annotations

import time

SHOWN_SHARE = 0.1  # the wait is shown beside the compute from a tenth of it
DOMINANT_SHARE = 0.5  # of the wait + compute: warned about


class DataWaitMixin:
    """Trainer mixin: `data_wait_seconds`, the time this rank spent fetching its micro-batches, all steps."""

    data_wait_seconds = 0.0

    def get_batch_samples(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return super().get_batch_samples(*args, **kwargs)
        finally:
            self.data_wait_seconds += time.perf_counter() - started


def per_step_text(seconds_per_step: float | None, waiting_per_step: float | None) -> str:
    """The closing line's s/step: the compute, and the wait for data beside it when it counts."""
    if not seconds_per_step:
        return "n/a"
    text = f"{seconds_per_step:.2f}s/step"
    # A very short step's tenth can round to "0.00s": shown only where the printed wait is not zero.
    if waiting_per_step and waiting_per_step >= max(SHOWN_SHARE * seconds_per_step, 0.005):
        text += f" + {waiting_per_step:.2f}s/step waiting for data"
    return text


def data_wait_warning(seconds_per_step: float | None, waiting_per_step: float | None,
                      num_workers: int) -> str | None:
    """A warning line when waiting for data took most of the training time, with what to change."""
    if not seconds_per_step or not waiting_per_step:
        return None
    share = waiting_per_step / (waiting_per_step + seconds_per_step)
    if share <= DOMINANT_SHARE:
        return None
    return (f"[train] waiting for data took {share:.0%} of each step ({waiting_per_step:.2f}s waiting, "
            f"{seconds_per_step:.2f}s computing): raise dataloader_num_workers (now {num_workers}) or make rows "
            "cheaper to read (smaller images, shorter rows, data on a local disk)")
