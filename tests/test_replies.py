"""What chat and samples show of a reply: no empty `<think></think>` block (Qwen3.5's non-thinking turns), one line
for transformers' kernel fall-backs instead of one per kernel."""

from __future__ import annotations

import logging

import pytest

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


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_kernel_fall_backs_are_one_line(capsys):
    logger, records = logging.getLogger(KERNELS_LOGGER), Records()
    level, filters = logger.level, logger.filters[:]
    logger.setLevel(logging.WARNING)  # whatever verbosity an earlier test left transformers' loggers at
    logger.filters.clear()  # a chat or samples run earlier in this process left its filter, which said its line then
    one_line = one_kernel_fallback_line()
    logger.addHandler(records)
    try:
        for kernel, package in (("causal_conv1d_fn", "causal_conv1d"), ("chunk_gated_delta_rule", "flash-linear-attention"),
                                ("causal_conv1d_update", "causal_conv1d")):  # transformers 5.23's words
            logger.warning("`%s` is falling back to its reference PyTorch implementation because `%s` is not "
                           "installed. This is correct but much slower; install `%s` for the optimized kernel.",
                           kernel, package, package)
        logger.warning("another warning")
    finally:
        logger.removeFilter(one_line)
        logger.removeHandler(records)
        logger.setLevel(level)
        logger.filters[:] = filters
    assert records.messages == ["another warning"]
    assert capsys.readouterr().err.splitlines() == [
        "[kernels] causal_conv1d is not installed (GPU kernels): their reference PyTorch implementations run "
        "(correct, slower)",
        "[kernels] flash-linear-attention is not installed (GPU kernels): their reference PyTorch implementations run "
        "(correct, slower)"]
