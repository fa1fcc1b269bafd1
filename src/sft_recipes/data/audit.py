"""Mask audit: see what the loss will train on before spending a GPU hour on it.

Renders a few conversations from the very ``input_ids`` / ``assistant_masks`` that training gets,
with the supervised tokens between ``[[`` and ``]]``, and sums up the masking of all of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from transformers import PreTrainedTokenizerBase

from sft_recipes.data.masking import KEPT, Conversation, MaskedConversation, drop_counts, mask_conversations

OPEN_MARK, CLOSE_MARK = "[[", "]]"


@dataclass(frozen=True)
class AuditExample:
    index: int  # position in the audited conversations
    drop_reason: str  # "" when kept
    marked_text: str  # supervised tokens between OPEN_MARK and CLOSE_MARK
    tokens: int
    supervised_tokens: int


@dataclass(frozen=True)
class AuditReport:
    conversations: int
    dropped: dict[str, int]  # drop reason -> conversations
    tokens: int  # in kept conversations
    supervised_tokens: int
    assistant_turns: int  # supervised turns in kept conversations
    turns_without_stop_token: tuple[tuple[int, int], ...]  # (conversation, message index) cut before the stop token
    empty_turns: int  # assistant turns with no text (empty or whitespace): only their end-of-turn token is trained
    rerendered_turns: int  # turns the template renders differently once later turns exist (masked as rendered)
    unrendered_reasoning_turns: int  # turns whose reasoning field the template leaves out
    prefix_render_conversations: int  # content-dependent renders, located by re-rendering prefixes
    untrained_turns: int  # assistant turns kept out of the loss (train: false / weight: 0 / train_turns: last)
    examples: tuple[AuditExample, ...]

    @property
    def kept(self) -> int:
        return self.conversations - sum(self.dropped.values())

    @property
    def supervised_share(self) -> float:
        return self.supervised_tokens / self.tokens if self.tokens else 0.0

    @property
    def every_turn_ends_with_stop_token(self) -> bool:
        return not self.turns_without_stop_token


def audit_masks(
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[Conversation],
    n: int = 3,
    max_length: int | None = None,
    **template_kwargs: Any,
) -> AuditReport:
    """Mask every conversation as training would; render the first ``n`` with their supervised spans marked."""
    masked = mask_conversations(tokenizer, conversations, max_length, **template_kwargs)
    kept = [row for row in masked if row.drop_reason == KEPT]
    return AuditReport(
        conversations=len(masked),
        dropped=drop_counts(row.drop_reason for row in masked),
        tokens=sum(len(row.input_ids) for row in kept),
        supervised_tokens=sum(sum(row.assistant_masks) for row in kept),
        assistant_turns=sum(len(row.turns) for row in kept),
        turns_without_stop_token=tuple(
            (index, turn.message_index)
            for index, row in enumerate(masked)
            if row.drop_reason == KEPT
            for turn in row.turns
            if not turn.ends_with_stop_token
        ),
        empty_turns=sum(row.empty_turns for row in kept),
        rerendered_turns=sum(row.rerendered_turns for row in kept),
        unrendered_reasoning_turns=sum(row.unrendered_reasoning_turns for row in kept),
        prefix_render_conversations=sum(row.used_prefix_renders for row in masked),
        untrained_turns=sum(row.untrained_turns for row in kept),
        examples=tuple(_example(tokenizer, index, row) for index, row in enumerate(masked[:n])),
    )


def mark_supervised(tokenizer: PreTrainedTokenizerBase, input_ids: list[int], assistant_masks: list[int]) -> str:
    """The decoded tokens with each run of supervised ones between OPEN_MARK and CLOSE_MARK."""
    pieces, run_start = [], 0
    for position in range(1, len(input_ids) + 1):
        if position == len(input_ids) or assistant_masks[position] != assistant_masks[run_start]:
            text = tokenizer.decode(input_ids[run_start:position], skip_special_tokens=False)
            pieces.append(f"{OPEN_MARK}{text}{CLOSE_MARK}" if assistant_masks[run_start] else text)
            run_start = position
    return "".join(pieces)


def format_report(report: AuditReport) -> str:
    """The report as text for a terminal: examples first, then the totals."""
    lines = []
    for example in report.examples:
        status = "kept" if example.drop_reason == KEPT else f"DROPPED ({example.drop_reason})"
        lines += [
            f"=== example {example.index}: {status}, {example.supervised_tokens}/{example.tokens} tokens supervised "
            f"(between {OPEN_MARK} {CLOSE_MARK})",
            example.marked_text,
            "",
        ]
    dropped = ", ".join(f"{reason}: {count}" for reason, count in sorted(report.dropped.items())) or "none"
    turns = f"assistant turns supervised: {report.assistant_turns}"
    if report.assistant_turns:  # none (e.g. every one cut away by max_length): a 'yes' would say max_length fits
        stop = "yes" if report.every_turn_ends_with_stop_token else _cut_turns(report.turns_without_stop_token)
        turns += f"; every one ends with its stop token: {stop}"
    lines += [
        f"conversations: {report.conversations}, kept {report.kept}, "
        f"dropped {sum(report.dropped.values())} ({dropped})",
        f"supervised tokens: {report.supervised_tokens}/{report.tokens} = {report.supervised_share:.1%} of kept tokens",
        turns,
    ]
    if report.untrained_turns:
        lines.append(
            f"assistant turns kept out of the loss (train: false, weight: 0 or train_turns: last): "
            f"{report.untrained_turns} (shown unmarked: context only)"
        )
    if report.empty_turns:
        lines.append(
            f"assistant turns with no text (empty or whitespace only): {report.empty_turns} "
            "(only their end-of-turn token is trained; conversations with nothing else are dropped)"
        )
    if report.rerendered_turns:
        lines.append(
            f"assistant turns the template renders differently once later turns exist: {report.rerendered_turns} "
            "(masked as the full conversation renders them; prefix-based maskers get these wrong)"
        )
    if report.unrendered_reasoning_turns:
        lines.append(
            f"assistant turns whose reasoning the template does not render (not trained on): "
            f"{report.unrendered_reasoning_turns}"
        )
    if report.prefix_render_conversations:
        lines.append(
            f"conversations whose text changes the template's structure (located by re-rendering prefixes): "
            f"{report.prefix_render_conversations}"
        )
    return "\n".join(lines)


def _cut_turns(turns: tuple[tuple[int, int], ...]) -> str:
    shown = ", ".join(f"conversation {conversation} message {message}" for conversation, message in turns[:5])
    more = f" and {len(turns) - 5} more" if len(turns) > 5 else ""
    return f"NO, {len(turns)} cut by max_length before their stop token ({shown}{more})"


def _example(tokenizer: PreTrainedTokenizerBase, index: int, row: MaskedConversation) -> AuditExample:
    return AuditExample(
        index=index,
        drop_reason=row.drop_reason,
        marked_text=mark_supervised(tokenizer, row.input_ids, row.assistant_masks),
        tokens=len(row.input_ids),
        supervised_tokens=sum(row.assistant_masks),
    )


def audit_dataset(dataset: Iterable[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, n: int,
                  sample: int = 1000, max_length: int | None = None, messages_field: str = "messages",
                  **template_kwargs: Any) -> AuditReport:
    """Audit the first `sample` rows of a (map-style or streamed) dataset, showing `n` of them."""
    conversations = [row[messages_field] for row in islice(dataset, max(n, sample))]
    return audit_masks(tokenizer, conversations, n=n, max_length=max_length, **template_kwargs)
