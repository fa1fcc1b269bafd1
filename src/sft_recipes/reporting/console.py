"""What a run shows its user: one compact line per logging step, quiet ranks > 0, and `train.log`.

- `one_voice`: accelerate's four INFO lines per FSDP checkpoint are left out (the completion marker's one line
  says it, `fault.checkpoints`); ranks > 0 draw no progress bars (datasets' map -- our "Tokenizing ..." and
  TRL's truncation --, transformers' weight loading) and log transformers/datasets warnings only:
  with N ranks the console otherwise shows every bar N times. Their own INFO lines (`[data] rank r
  trained on ...`) and warnings stay, but for one that every rank meets alike: transformers' "`causal_conv1d_fn`
  is falling back to its reference PyTorch implementation" (a Qwen3.5 run without a GPU kernel package)
  is left to rank 0, which says it once per missing package (`replies.one_kernel_fallback_line`), not 16
  times per kernel on 2 nodes of 8 GPUs; so is fla's "Triton is not supported on current platform" on CPU.
- `step_line`: the log of a step as one line -- `step 20/60 | loss 1.2345 | eval loss 1.3010 (step 10)
  | lr 2.00e-05 | grad norm 0.84 | 1,854 tokens/s/device | MFU 41.2% | peak 61.3 GiB | ETA 0:04:10`
  -- instead of transformers' dict of quoted strings; an eval prints `step 10/60 | eval loss 1.3010`.
  `use_step_lines` swaps it into the Trainer's progress (or, with disable_tqdm, printer) callback.
- `open_train_log`: `output_dir/train.log` gets everything rank 0's console shows (its stdout and
  stderr, the logging handlers that write there included; a progress bar as its last frame, not
  every redraw), appended run after run (a resume continues the same file), and every other rank's
  refusal line (`errors.one_line_refusals`). It is held in memory until the run is known to train
  (`keep_train_log`) or refuses, so re-running a finished run writes nothing. A refusal that only the run can make (torchrun then
  prints its ChildFailedError report after ours) is found there, or as the first `error:` line of
  the console.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import time
import warnings
from pathlib import Path

from transformers.trainer_callback import PrinterCallback, ProgressCallback

from sft_recipes.errors import forget_refusal_hooks, on_refusal
from sft_recipes.reporting.replies import FLA_ON_CPU, KERNELS_LOGGER, drop_kernel_fallbacks, one_kernel_fallback_line

TRAIN_LOG = "train.log"
ACCELERATE_FSDP_LOGGER = "accelerate.utils.fsdp_utils"


def process_rank() -> int:
    """The launcher's rank (torchrun sets RANK), read without creating any distributed state."""
    return int(os.environ.get("RANK", "0"))


def one_voice(rank: int | None = None) -> None:
    # accelerate says every FSDP checkpoint in four INFO lines (model and optimizer, saving and saved); the
    # checkpoint's completion marker says it in one (fault.checkpoints).
    logging.getLogger(ACCELERATE_FSDP_LOGGER).setLevel(logging.WARNING)
    if (process_rank() if rank is None else rank) == 0:
        one_kernel_fallback_line()
        return
    import datasets
    import transformers

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_warning()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_warning()
    logging.getLogger(KERNELS_LOGGER).addFilter(drop_kernel_fallbacks)
    warnings.filterwarnings("ignore", message=FLA_ON_CPU, category=UserWarning)


# ── One line per logging step ────────────────────────────────────────────────────────────────────

def _duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(max(seconds, 0.0))))


# What a step line shows of a training log, in order (the rest goes to MLflow only).
STEP_FIELDS = (("learning_rate", "lr {:.2e}"), ("grad_norm", "grad norm {:.3g}"),
               ("tokens_per_second_per_device", "{:,.0f} tokens/s/device"), ("mfu", "MFU {:.1%}"),
               ("packing_efficiency", "packing {:.1%}"), ("peak_memory_gib", "peak {:.2f} GiB"),
               ("compiled_graphs", "compiled graphs {:.0f}"))  # torch_compile: sft_recipes.compile


def step_line(logs: dict, step: int, max_steps: int, last_eval: tuple[int, float] | None = None,
              eta_seconds: float | None = None) -> str:
    """A training, eval or end-of-training log as one line (keys the line does not show go to MLflow only)."""
    where = f"step {step}/{max_steps}"
    if "loss" not in logs and "eval_loss" in logs:
        return f"{where} | eval loss {logs['eval_loss']:.4f}"
    # The end-of-training log is the one with train_loss: with include_num_input_tokens_seen transformers puts
    # train_runtime (and train_tokens_per_second) in every step's log too.
    if "train_loss" in logs:
        return f"{where} | trained in {_duration(logs.get('train_runtime', 0.0))} | mean loss {logs['train_loss']:.4f}"
    parts = [where]
    if "loss" in logs:
        parts.append(f"loss {logs['loss']:.4f}")
    if last_eval is not None:
        parts.append(f"eval loss {last_eval[1]:.4f} (step {last_eval[0]})")
    parts += [shown.format(logs[key]) for key, shown in STEP_FIELDS if key in logs]
    if eta_seconds is not None:
        parts.append(f"ETA {_duration(eta_seconds)}")
    return " | ".join(parts)


class _StepLines:
    """The state a step line needs: the last eval loss, and the pace since training (or its resume) began."""

    def _start_clock(self, state) -> None:
        self.clock = (time.perf_counter(), state.global_step)
        self.last_eval = None

    def _line(self, state, logs: dict) -> str:
        if "eval_loss" in logs and "loss" not in logs:
            self.last_eval = (state.global_step, logs["eval_loss"])
        started, first_step = getattr(self, "clock", (time.perf_counter(), state.global_step))
        done = state.global_step - first_step
        eta = (time.perf_counter() - started) / done * (state.max_steps - state.global_step) if done > 0 else None
        last_eval = getattr(self, "last_eval", None)
        return step_line(logs, state.global_step, state.max_steps, last_eval if "loss" in logs else None, eta)


class StepLineProgressCallback(_StepLines, ProgressCallback):
    """transformers' progress bar, with one compact line per log above it."""

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        self._start_clock(state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            line = self._line(state, logs)
            if self.training_bar is not None:
                self.training_bar.write(line)
            else:
                print(line, flush=True)


class StepLinePrinterCallback(_StepLines, PrinterCallback):
    """disable_tqdm: the same lines, printed."""

    def on_train_begin(self, args, state, control, **kwargs):
        self._start_clock(state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            print(self._line(state, logs), flush=True)


def use_step_lines(trainer) -> None:
    """Replace the Trainer's default progress (or printer) callback with the step-line one."""
    for default, ours in ((ProgressCallback, StepLineProgressCallback), (PrinterCallback, StepLinePrinterCallback)):
        if any(type(callback) is default for callback in trainer.callback_handler.callbacks):
            trainer.remove_callback(default)
            trainer.add_callback(ours)


# ── train.log ────────────────────────────────────────────────────────────────────────────────────

class _Tee:
    """A console stream that also writes each finished line to the log (after its last carriage return:
    a progress bar's final frame, not its every redraw)."""

    def __init__(self, stream, log):
        self._stream, self._log, self._pending = stream, log, ""

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        self._pending += text
        if "\n" in self._pending:
            *lines, self._pending = self._pending.split("\n")
            self._log.write("".join(line.rsplit("\r", 1)[-1] + "\n" for line in lines))
            self._log.flush()
        return written

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding, ... as the console's
        return getattr(self._stream, name)


class _TrainLog:
    """output_dir/train.log, held in memory until the run is known to train (`keep_train_log`) or refuses: a
    finished run's re-run (nothing to train) writes nothing."""

    def __init__(self, path: Path, rank: int):
        self.path, self.rank, self._held, self._file, self._lost = path, rank, [], None, False

    def write(self, text: str) -> None:
        if self._lost:
            return
        if self._file is None:
            self._held.append(text)
        else:
            self._guarded(self._file.write, text)

    def flush(self) -> None:
        if self._file is not None:
            self._guarded(self._file.flush)

    def keep(self) -> None:
        if self._file is None and self.rank == 0 and not self._lost:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 -- open for the life of the process
            self._guarded(self._file.write, "".join(self._held))
            self._held.clear()
            self.flush()

    def _guarded(self, write, *text: str) -> None:
        """A log that cannot be written (the disk under output_dir filled, e.g. during a save) is given up: the
        console goes on, and a refusal printed through the tee (`No room for ...`) still reaches it and exits 2,
        instead of an OSError raised inside the refusal's own print (`Error in sys.excepthook`, exit 1)."""
        try:
            write(*text)
        except OSError:
            self._lost, file, self._file = True, self._file, None
            with contextlib.suppress(OSError):  # its buffer cannot be written either: dropped, not raised at exit
                file.close()

    def refused(self, line: str) -> None:
        try:
            if self.rank == 0:
                self.keep()  # the line itself came through the console
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a", encoding="utf-8") as log:
                    log.write(f"[rank {self.rank}] {line}\n")
        except OSError:
            pass  # output_dir cannot be written (the refusal may say so): the line is on the console


_TRAIN_LOG: list[_TrainLog] = []


def keep_train_log() -> None:
    """The run trains: write what the log held so far, and everything from now on."""
    for log in _TRAIN_LOG:
        log.keep()


def close_train_log() -> None:
    """Close the run's train.log and forget its refusal hook (`sft_recipes.train()` between two runs in one process;
    the console streams the tee replaced are restored by `in_process`, which saved them)."""
    for log in _TRAIN_LOG:
        if log._file is not None:
            log._file.close()
    _TRAIN_LOG.clear()
    forget_refusal_hooks()


def open_train_log(output_dir: str | os.PathLike, rank: int | None = None) -> Path:
    """Rank 0: tee the console into output_dir/train.log (held until `keep_train_log` or a refusal). Every rank:
    its refusal goes there too."""
    path = Path(output_dir) / TRAIN_LOG
    log = _TrainLog(path, process_rank() if rank is None else rank)
    _TRAIN_LOG[:] = [log]
    on_refusal(log.refused)
    if log.rank != 0:
        return path
    log.write(f"== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(sys.argv)}\n")
    streams = {}
    for name in ("stdout", "stderr"):
        console = getattr(sys, name)
        streams[id(console)] = tee = _Tee(console, log)
        setattr(sys, name, tee)
    loggers = [logging.getLogger(), *(logger for logger in logging.Logger.manager.loggerDict.values()
                                      if isinstance(logger, logging.Logger))]
    for logger in loggers:  # handlers made before now hold the console stream itself
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in streams:
                handler.setStream(streams[id(handler.stream)])
    return path
