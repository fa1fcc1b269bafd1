"""What chat and samples show of a reply: no empty `<think></think>` block (Qwen3.5's non-thinking turns), one line
for transformers' kernel fall-backs instead of one per kernel."""

from __future__ import annotations

import logging
import warnings

import pytest

from conftest import LoggedMessages
from sft_recipes.reporting.replies import KERNELS_LOGGER, ReplyStreamer, one_kernel_fallback_line, shown_reply


def test_an_empty_thinking_block_is_not_shown_a_full_one_is():
    assert shown_reply("<think>\n\n</think>\n\nParis.") == "Paris."
    assert shown_reply("<think>\nThe capital.\n</think>\n\nParis.") == "<think>\nThe capital.\n</think>\n\nParis."
    assert shown_reply("Paris. <think></think>") == "Paris. <think></think>"  # only a reply's start


@pytest.mark.parametrize(("chunks", "shown"), [
    (["<th", "ink>\n", "\n</think>\n\n", "Paris ", "is it."], "Paris is it.\n"),
    (["<think>\nThe ", "capital.\n</think>\n\n", "Paris."], "<think>\nThe capital.\n</think>\n\nParis.\n"),
    (["Paris ", "is it."], "Paris is it.\n"),
    (["<think>\n\n"], "<think>\n\n\n"),  # the stream ended inside the block: nothing held back
])
def test_the_streamed_reply_holds_back_only_a_start_that_may_be_an_empty_block(chunks, shown, capsys):
    streamer = ReplyStreamer(tokenizer=None)
    printed = []
    for chunk in chunks:
        streamer.on_finalized_text(chunk)
        printed.append(capsys.readouterr().out)
    streamer.on_finalized_text("", stream_end=True)
    assert "".join(printed) + capsys.readouterr().out == shown
    if chunks[0] == "Paris ":
        assert printed[0] == "Paris "  # a plain reply streams from its first word


def _warn_kernel_fall_backs(logger):
    for kernel, package in (("causal_conv1d_fn", "causal_conv1d"), ("chunk_gated_delta_rule", "flash-linear-attention"),
                            ("causal_conv1d_update", "causal_conv1d")):  # transformers 5.23's words
        logger.warning("`%s` is falling back to its reference PyTorch implementation because `%s` is not "
                       "installed. This is correct but much slower; install `%s` for the optimized kernel.",
                       kernel, package, package)


def test_kernel_fall_backs_are_one_line_per_run(capsys):
    """Each run (two train() calls in one process, or a chat after a run) says its lines, through one filter."""
    logger, records = logging.getLogger(KERNELS_LOGGER), LoggedMessages()
    level, filters = logger.level, logger.filters[:]
    logger.setLevel(logging.WARNING)  # whatever verbosity an earlier test left transformers' loggers at
    logger.addHandler(records)
    try:
        for _ in range(2):
            one_kernel_fallback_line()
            _warn_kernel_fall_backs(logger)
        logger.warning("another warning")
        installed = logger.filters[:]
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
        logger.filters[:] = filters
    assert sum(type(installed_filter).__name__ == "_OneLinePerKernelPackage" for installed_filter in installed) == 1
    assert records.messages == ["another warning"]
    assert capsys.readouterr().err.splitlines() == 2 * [
        "[kernels] causal_conv1d is not installed (GPU kernels): their reference PyTorch implementations run "
        "(correct, slower)",
        "[kernels] flash-linear-attention is not installed (GPU kernels): their reference PyTorch implementations run "
        "(correct, slower)"]


def test_other_ranks_drop_the_kernel_fall_backs_once_per_process(monkeypatch):
    import datasets
    import transformers

    from sft_recipes.reporting.console import one_voice

    for module, quieting in ((datasets, "disable_progress_bars"), (datasets.logging, "set_verbosity_warning"),
                             (transformers.utils.logging, "disable_progress_bar"),
                             (transformers.utils.logging, "set_verbosity_warning")):
        monkeypatch.setattr(module, quieting, lambda: None)  # the rest of this process's tests keep their bars
    logger, records = logging.getLogger(KERNELS_LOGGER), LoggedMessages()
    level, filters = logger.level, logger.filters[:]
    logger.setLevel(logging.WARNING)
    logger.addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as warned:  # the filters one_voice adds end with the block
            warnings.simplefilter("always")
            for _ in range(2):  # two runs in one rank-1 process
                one_voice(rank=1)
            _warn_kernel_fall_backs(logger)
            logger.warning("another warning")
            added = len(logger.filters) - len(filters)
            warnings.warn("Triton is not supported on current platform, roll back to CPU.", UserWarning)  # fla's
            warnings.warn("another user warning", UserWarning)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
        logger.filters[:] = filters
    assert (added, records.messages) == (1, ["another warning"])
    assert [str(warning.message) for warning in warned] == ["another user warning"]
