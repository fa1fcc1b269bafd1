"""Chat conversations -> ``input_ids`` + assistant-only loss masks, for any chat template.

No ``{% generation %}`` markers are needed. The rendered conversation is the truth: we supervise
exactly the assistant tokens the model sees in training, even where a template renders earlier
turns differently once later turns exist (Qwen3 drops earlier reasoning, harmony ends the last
turn with ``<|return|>`` and earlier ones with ``<|end|>``).

How a batch is masked:

1. Each conversation is rendered once, as ``tokenizer.apply_chat_template(tokenize=False)`` would.
2. Its *shape* (roles; which text fields are set, empty or absent; every other field verbatim;
   the template kwargs) is probed once per tokenizer and template: it is rendered with a unique
   sentinel in each text field. On that skeleton each assistant turn is located:
   - start: the end of the generation prompt, i.e. where the render of the earlier messages with
     ``add_generation_prompt=True`` stops agreeing with the full render, compared right after the
     previous message's text (so re-rendered earlier turns cannot shift it). Right after another
     assistant turn that closes differently when last (harmony's ``<|return|>`` vs ``<|end|>``), the
     start must lie past that turn's end: two replies in a row are both supervised;
   - end: the first special token after the turn's last text (its stop token: ``<|eot_id|>``,
     ``<|im_end|>``, ``<|end|>``, ``<|return|>``) plus the whitespace the template writes right
     after it (ChatML's newline), the same tokens the prefix method of the reference recipe
     supervises wherever its assumption holds.
3. The real render must be the skeleton with the real texts in the sentinel slots (verbatim or
   whitespace-trimmed, as templates ``trim``); skeleton spans then map to character spans of the
   real render by arithmetic.
4. One batched fast-tokenizer pass (no special tokens added: templates that emit BOS keep exactly
   one). A token is supervised iff it starts inside a span: a token merging the prompt's last
   newline with the reply's first is left out, so no prompt character is ever a target.

Empty replies, one rule: a reply whose rendered texts are empty or whitespace only is an *empty
reply*. It stays in the conversation, and what the template writes for it is supervised like any
turn: its stop token (plus the whitespace itself where the template keeps it, or Qwen3's empty
think block on the last turn). That is what the data says the assistant did, and the model must see
its turns end; a conversation whose every reply is empty teaches nothing else and is dropped as
``empty_assistant_turns``. ``""`` and ``"  "`` are treated alike (Llama 3.1 trims both to nothing).

A template whose structure depends on a text's content (Qwen3 splitting ``<think>`` out of
``content``) fails step 3 for that conversation. If moving each ``<think>...</think>`` out of an
assistant ``content`` into ``reasoning_content`` renders the very same text, the turns are located
on that form: each turn is supervised as the full render shows it (earlier replies without their
reasoning, the last with it). Otherwise it is masked by rendering its prefixes in string space (the
reference recipe's method), which is right only where the template renders each turn the same
whatever follows it; where it does not, the conversation is dropped with reason
``prefix_mismatch``. Nothing is ever masked silently wrong or silently empty.

Tool calls (`tools.py`): an assistant message's ``tool_calls`` are part of its turn. Each row is
rendered with its own tools (``tools=``, carried on its first message). The last call's function
name is a sentinel slot of the probe (every template renders the name verbatim), and such a turn
ends at the last special token of the call as the render of the conversation up to that message
writes it (``<|eot_id|>`` for Llama-3.1, ``<|im_end|>`` for Qwen3, ``<|call|>`` for gpt-oss, whose
call holds ``<|channel|>`` and ``<|message|>`` too). Tool definitions and tool results are never
supervised: they are not assistant messages. A template that renders one call per message
(Llama-3.1 raises on more, gpt-oss renders only the first) drops a message with several calls as
``several_tool_calls`` rather than train what the template would not show or split the calls into
turns the data never had; a template that renders no tools is refused (`check_renders_tools`).
"""

from __future__ import annotations

import json
import re
import weakref
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from os.path import commonprefix
from typing import Any

from jinja2 import TemplateError
from tokenizers import Encoding
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from sft_recipes.data.tools import TOOLS_FIELD, ToolDataError, parsed_tool_calls, parsed_tools

Message = dict[str, Any]
Conversation = list[Message]

# Fields a template renders as text (transformers aliases the three reasoning names to each other).
REASONING_FIELDS = ("thinking", "reasoning_content", "reasoning")
TEXT_FIELDS = ("content", *REASONING_FIELDS)

KEPT = ""
NO_ASSISTANT_TURN = "no_assistant_turn"
EMPTY_ASSISTANT_TURNS = "empty_assistant_turns"
PREFIX_MISMATCH = "prefix_mismatch"
TRUNCATED_AWAY = "truncated_away"
SEVERAL_TOOL_CALLS = "several_tool_calls"
NO_TRAINED_TURN = "no_trained_turn"
DROP_REASONS = (NO_ASSISTANT_TURN, EMPTY_ASSISTANT_TURNS, PREFIX_MISMATCH, TRUNCATED_AWAY, SEVERAL_TOOL_CALLS,
                NO_TRAINED_TURN)
# Per-message flags that keep an assistant turn out of the loss (axolotl's `train`, LLaMA-Factory / axolotl `weight`);
# taken off the message before rendering, so the template never sees them.
TRAIN_FLAG, WEIGHT_FLAG = "train", "weight"
# The probe's slot for an assistant message's last tool call: its function name, which templates render verbatim.
TOOL_CALL_FIELD = "\ue002tool_call"

# Private-use code points: no template filter (trim, strip, lstrip('\n')) touches them.
_SENTINEL = re.compile("\ue000([0-9]+)\ue001")
_MAX_CACHED_SHAPES = 4096


@dataclass(frozen=True)
class SupervisedTurn:
    """One assistant turn's supervised tokens in a masked conversation."""

    message_index: int
    token_start: int
    token_end: int  # exclusive; clipped to the tokens kept after truncation
    stop_token: str
    ends_with_stop_token: bool  # False when truncation cut the turn before its stop token


@dataclass(frozen=True)
class MaskedConversation:
    input_ids: list[int]
    assistant_masks: list[int]
    drop_reason: str  # KEPT ("") or one of DROP_REASONS
    text: str  # the rendered conversation, cut where input_ids were truncated
    turns: tuple[SupervisedTurn, ...]
    empty_turns: int  # assistant turns with no rendered text: only their stop token is supervised
    rerendered_turns: int  # assistant turns rendered differently once later turns exist
    unrendered_reasoning_turns: int  # assistant turns whose reasoning field the template does not show
    used_prefix_renders: bool  # content-dependent template: located by re-rendering prefixes
    untrained_turns: int = 0  # assistant turns rendered but kept out of the loss (train: false / weight: 0)


def tokenize_conversations(
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[Conversation],
    max_length: int | None = None,
    **template_kwargs: Any,
) -> dict[str, list]:
    """Columns ``input_ids``, ``assistant_masks`` (1 = in the loss) and ``drop_reason`` per row.

    Made for ``datasets.map(batched=True)``: rows stay aligned with the input; keep the rows with
    ``drop_reason == ""`` (as `DatasetFormat.prepare` does). ``max_length`` keeps the first tokens and the
    mask bits under them; a row left with no supervised token is dropped as ``truncated_away``.
    ``template_kwargs`` (``enable_thinking``, ``reasoning_effort``, ``tools``...) reach the template.
    TRL 1.16 turns these columns into labels with the default ``SFTConfig`` (leave
    ``assistant_only_loss`` off: TRL refuses it for pre-tokenized data).
    """
    masked = mask_conversations(tokenizer, conversations, max_length, **template_kwargs)
    return {
        "input_ids": [row.input_ids for row in masked],
        "assistant_masks": [row.assistant_masks for row in masked],
        "drop_reason": [row.drop_reason for row in masked],
    }


def drop_counts(drop_reasons: Iterable[str]) -> dict[str, int]:
    """How many rows each drop reason removed (kept rows are not counted)."""
    return dict(Counter(reason for reason in drop_reasons if reason != KEPT))


def mask_conversations(
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[Conversation],
    max_length: int | None = None,
    **template_kwargs: Any,
) -> list[MaskedConversation]:
    """``tokenize_conversations`` with everything known about each row (for audits)."""
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be a positive number of tokens or None, got {max_length}.")
    normalized = [_normalized(conversation, row) for row, conversation in enumerate(conversations)]
    rows = [(conversation, tools) for conversation, tools, _ in normalized]
    conversations = [conversation for conversation, _ in rows]
    with_tools = [tools for _, tools in rows if tools]
    masker = _masker_for(tokenizer, template_kwargs.get("tools") or (with_tools[0] if with_tools else None))
    if not any(tools or _calls_tools(conversation) for conversation, tools in rows):
        texts = masker.render_batch(conversations, template_kwargs)
        located = [masker.locate(conv, text, template_kwargs) for conv, text in zip(conversations, texts)]
    else:  # each row rendered with its own tools
        check_renders_tools(tokenizer, **template_kwargs)
        one_call = masker.renders_one_call_per_message(template_kwargs)
        texts, located = [], []
        for conversation, tools in rows:
            if one_call and any(len(message.get("tool_calls", ())) > 1 for message in conversation):
                texts.append("")
                located.append(_Located((), SEVERAL_TOOL_CALLS))
                continue
            kwargs = {**template_kwargs, "tools": tools} if tools else template_kwargs
            texts.append(masker.render_batch([conversation], kwargs)[0])
            located.append(masker.locate(conversation, texts[-1], kwargs))
    located = [_without_untrained(row, untrained) for row, (_, _, untrained) in zip(located, normalized)]
    encodings = masker.encode(texts)
    return [_masked(*row, max_length) for row in zip(texts, located, encodings)]


def _without_untrained(located: _Located, untrained: frozenset[int]) -> _Located:
    """The located turns less those of messages flagged out of the loss; none left is ``no_trained_turn``."""
    if not untrained or located.drop_reason != KEPT:
        return located
    turns = tuple(turn for turn in located.turns if turn.message_index not in untrained)
    return replace(located, turns=turns, drop_reason=KEPT if turns else NO_TRAINED_TURN,
                   untrained_turns=len(located.turns) - len(turns))


# ---------------------------------------------------------------------------------------------
# Locating assistant turns in character space


@dataclass(frozen=True)
class _CharTurn:
    message_index: int
    start: int
    stop: int  # where the stop token starts
    end: int
    stop_token: str


@dataclass(frozen=True)
class _Located:
    turns: tuple[_CharTurn, ...]
    drop_reason: str
    empty_turns: int = 0
    rerendered_turns: int = 0
    unrendered_reasoning_turns: int = 0
    used_prefix_renders: bool = False
    untrained_turns: int = 0


@dataclass(frozen=True)
class _SkeletonTurn:
    """A turn's boundaries as (segment index, offset in that segment) of the skeleton."""

    message_index: int
    start: tuple[int, int]
    stop: tuple[int, int]
    end: tuple[int, int]
    stop_token: str
    has_text: bool  # False for an empty reply: only its stop token is supervised


@dataclass(frozen=True)
class _Skeleton:
    """The sentinel render of one conversation shape, cut at the sentinels."""

    segments: tuple[str, ...]  # len(slots) + 1 literal pieces around the text slots
    slots: tuple[tuple[int, str], ...]  # (message index, field) rendered between segments k and k+1
    turns: tuple[_SkeletonTurn, ...]
    empty_turns: int
    rerendered_turns: int
    unrendered_reasoning_turns: int


class _TemplateMasker:
    """Per tokenizer and chat template: renders, probes shapes (cached) and tokenizes."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: str):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        special = sorted(
            (token.content for token in tokenizer.added_tokens_decoder.values() if token.special), key=len, reverse=True
        )
        if not special:
            raise ValueError(
                "The tokenizer has no special tokens, so no assistant turn can end with a stop token; "
                "use a tokenizer whose end-of-turn token (e.g. <|eot_id|>, <|im_end|>) is a special added token."
            )
        self.special_tokens = re.compile("|".join(map(re.escape, special)))
        # Keyed by (template kwargs, shape); None marks a shape whose turns cannot be located on a skeleton.
        self.skeletons: dict[tuple, _Skeleton | None] = {}
        self.tool_support: dict[tuple, bool] = {}  # (question, template kwargs) -> answer (tool templates)

    # -- rendering ------------------------------------------------------------------------------

    def render_batch(self, conversations: list[Conversation], template_kwargs: dict[str, Any]) -> list[str]:
        try:
            return self._render(conversations, template_kwargs)
        except TemplateError:
            for row, conversation in enumerate(conversations):  # name the row that the template rejects
                try:
                    self._render([conversation], template_kwargs)
                except TemplateError as error:
                    raise ValueError(f"The chat template rejects conversation {row} of this batch: {error}") from error
            raise

    def _render(
        self, conversations: list[Conversation], template_kwargs: dict[str, Any], add_generation_prompt: bool = False
    ) -> list[str]:
        # Exactly what apply_chat_template(tokenize=False) renders, without its per-call overhead.
        rendered, _ = render_jinja_template(
            conversations=conversations,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            **{**self.tokenizer.special_tokens_map, **template_kwargs},
        )
        return rendered

    def _render_prefix(
        self, conversation: Conversation, template_kwargs: dict[str, Any], add_generation_prompt: bool
    ) -> str | None:
        """The render of a conversation's first messages; None when the template refuses them."""
        if not conversation and not add_generation_prompt:
            return ""
        try:
            return self._render([conversation], template_kwargs, add_generation_prompt)[0]
        except TemplateError:
            return None  # e.g. an empty message list, which most templates index into

    def renders_one_call_per_message(self, template_kwargs: dict[str, Any]) -> bool:
        """Whether the template refuses (Llama-3.1) or leaves out (gpt-oss) the second call of a message."""
        key = ("one_call", _kwargs_key(template_kwargs))
        if key not in self.tool_support:
            names = [_sentinel(0), _sentinel(1)]
            tools = [{"type": "function", "function": {"name": name, "description": "", "parameters": {}}}
                     for name in names]
            calls = [{"type": "function", "function": {"name": name, "arguments": {}}} for name in names]
            conversation = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": calls}]
            try:
                rendered = self._render([conversation], {**template_kwargs, "tools": tools})[0]
                self.tool_support[key] = rendered.count(names[1]) < 2  # the schema's mention and the call's
            except TemplateError:
                self.tool_support[key] = True
        return self.tool_support[key]

    # -- locating turns -------------------------------------------------------------------------

    def locate(self, conversation: Conversation, text: str, template_kwargs: dict[str, Any]) -> _Located:
        if not any(message["role"] == "assistant" for message in conversation):
            return _Located((), NO_ASSISTANT_TURN)
        key = (_kwargs_key(template_kwargs), _shape(conversation))
        skeleton = self._skeleton(key, conversation, template_kwargs)
        if skeleton is not None and not text.startswith(skeleton.segments[0]):
            # The header changed since the probe (gpt-oss prints today's date): probe again.
            del self.skeletons[key]
            skeleton = self._skeleton(key, conversation, template_kwargs)
        offsets = None if skeleton is None else _segment_offsets(skeleton, conversation, text)
        if offsets is None:
            moved = _reasoning_moved_out_of_content(conversation)
            if moved is not None and self._render([moved], template_kwargs)[0] == text:
                return self.locate(moved, text, template_kwargs)  # same render, so the same turns
            return self._locate_by_prefix_renders(conversation, text, template_kwargs)
        if not any(turn.has_text for turn in skeleton.turns):
            return _Located((), EMPTY_ASSISTANT_TURNS, skeleton.empty_turns)
        turns = tuple(
            _CharTurn(
                turn.message_index,
                offsets[turn.start[0]] + turn.start[1],
                offsets[turn.stop[0]] + turn.stop[1],
                offsets[turn.end[0]] + turn.end[1],
                turn.stop_token,
            )
            for turn in skeleton.turns
        )
        return _Located(
            turns,
            KEPT,
            skeleton.empty_turns,
            skeleton.rerendered_turns,
            skeleton.unrendered_reasoning_turns,
        )

    def _skeleton(self, key: tuple, conversation: Conversation, template_kwargs: dict[str, Any]) -> _Skeleton | None:
        if key not in self.skeletons:
            if len(self.skeletons) >= _MAX_CACHED_SHAPES:
                self.skeletons.clear()  # only shapes with many literal fields get here
            self.skeletons[key] = self._probe(conversation, template_kwargs)
        return self.skeletons[key]

    def _probe(self, conversation: Conversation, template_kwargs: dict[str, Any]) -> _Skeleton | None:
        probe, sentinel_slots = _sentinel_probe(conversation)
        probe, full = self._keep_zero_width_slots(probe, sentinel_slots, conversation, template_kwargs)
        pieces = _SENTINEL.split(full)  # literal, sentinel number, literal, ...
        segments = tuple(pieces[0::2])
        slots = tuple(sentinel_slots[int(number)] for number in pieces[1::2])
        sentinels = [_sentinel(int(number)) for number in pieces[1::2]]
        owners = [message_index for message_index, _ in slots]
        if owners != sorted(owners):
            raise ValueError(
                "The chat template renders messages out of order, so assistant turns cannot be located "
                "in its output; assistant-only masking does not support this template."
            )
        turns, empty_turns, rerendered, unrendered_reasoning = [], 0, 0, 0
        for index, message in enumerate(conversation):
            if message["role"] != "assistant":
                continue
            # A name rendered again later (gpt-oss heads a tool result with the call's name) is not the turn's.
            mine = [slot for slot, owner in enumerate(owners) if owner == index and sentinels[slot] not in sentinels[:slot]]
            rendered_texts = {slots[slot][1] for slot in mine}
            if _has_text(message, REASONING_FIELDS) and not rendered_texts.intersection(REASONING_FIELDS):
                unrendered_reasoning += 1
            has_text = any(_has_text(message, [field]) for field in rendered_texts)
            empty_turns += not has_text
            if not mine:
                continue  # the template renders nothing of this message: nothing to supervise
            first, last = mine[0], mine[-1]
            before = self._render_prefix(probe[:index], template_kwargs, add_generation_prompt=False)
            prompt = self._render_prefix(probe[:index], template_kwargs, add_generation_prompt=True)
            if before is None or prompt is None:
                return None
            anchor = sentinels[first - 1] if first else None
            before_tail, prompt_tail = _after(before, anchor), _after(prompt, anchor)
            gap = segments[first]
            if before_tail is None or prompt_tail is None:
                return None
            start = len(commonprefix([gap, prompt_tail]))
            if not (prompt_tail.startswith(before_tail) and gap.startswith(before_tail)):
                # The message before this turn closes differently once the turn follows. Fine for an
                # assistant turn closed in this same gap (harmony: <|return|> when last, <|end|> when
                # followed), if the generation prompt still matches past that turn's end; else unknown.
                previous = turns[-1] if turns and turns[-1].message_index == index - 1 else None
                if previous is None or previous.end[0] != first or start <= previous.end[1]:
                    return None
            closing = segments[last + 1]
            through = self._render_prefix(probe[: index + 1], template_kwargs, add_generation_prompt=False)
            if slots[last][1] == TOOL_CALL_FIELD:
                # The call ends at its last special token as the render up to this message writes it
                # (gpt-oss: <|channel|> and <|message|> inside the call, <|call|> closing it).
                call_tail = None if through is None else _after(through, sentinels[last])
                if call_tail is None or not closing.startswith(call_tail):
                    return None
                stops = list(self.special_tokens.finditer(call_tail))
                stop = stops[-1] if stops else None
            else:
                stop = self.special_tokens.search(closing)
            if stop is None:
                raise ValueError(
                    f"The chat template closes an assistant turn with {closing[:40]!r}, which holds no special "
                    "token, so the model could never learn where its turn stops. Use a template whose assistant "
                    "turns end with a special end-of-turn token, or a tokenizer that marks that token special."
                )
            end = stop.end() + len(closing[stop.end() :]) - len(closing[stop.end() :].lstrip())
            turns.append(
                _SkeletonTurn(
                    index, (first, start), (last + 1, stop.start()), (last + 1, end), stop.group(), has_text,
                )
            )
            if through is None or not (full.startswith(prompt) and full.startswith(through)):
                rerendered += 1
        return _Skeleton(segments, slots, tuple(turns), empty_turns, rerendered, unrendered_reasoning)

    def _keep_zero_width_slots(
        self,
        probe: Conversation,
        sentinel_slots: dict[int, tuple[int, str]],
        conversation: Conversation,
        template_kwargs: dict[str, Any],
    ) -> tuple[Conversation, str]:
        """The probe and its render, with a sentinel left in each empty text the template renders like any other.

        Such an empty text is a zero-width slot, so an empty reply still ends at its own stop token
        (gpt-oss: an empty final message after the analysis one). Empty texts the template branches
        on (a system message left out when empty) go back to "".
        """
        empty = {number for number, (index, field) in sentinel_slots.items()
                 if _field_value(conversation[index], field) == ""}
        if not empty:
            return probe, self._render([probe], template_kwargs)[0]
        plain_probe = _with_texts_emptied(probe, [sentinel_slots[number] for number in empty])
        plain = self._render([plain_probe], template_kwargs)[0]

        def keeping(kept: set[int]) -> tuple[Conversation, str] | None:
            """The probe with only the ``kept`` empty texts as sentinels, if it renders like the plain one."""
            candidate = _with_texts_emptied(probe, [sentinel_slots[number] for number in empty - kept])
            try:
                rendered = self._render([candidate], template_kwargs)[0]
            except TemplateError:  # gpt-oss refuses content beside thinking in a call: an empty one is no slot
                return None
            return (candidate, rendered) if _without_sentinels(rendered, kept) == plain else None

        return (
            keeping(empty)
            or keeping({number for number in empty if keeping({number})})
            or (plain_probe, plain)
        )

    def _locate_by_prefix_renders(
        self, conversation: Conversation, text: str, template_kwargs: dict[str, Any]
    ) -> _Located:
        """The reference recipe's prefix method in string space, for content-dependent templates."""
        turns, empty_turns = [], 0
        for index, message in enumerate(conversation):
            if message["role"] != "assistant":
                continue
            empty_turns += not (_has_text(message, TEXT_FIELDS) or "tool_calls" in message)
            before = self._render_prefix(conversation[:index], template_kwargs, add_generation_prompt=False)
            prompt = self._render_prefix(conversation[:index], template_kwargs, add_generation_prompt=True)
            through = self._render_prefix(conversation[: index + 1], template_kwargs, add_generation_prompt=False)
            if None in (before, prompt, through) or not (
                text.startswith(before) and prompt.startswith(before) and text.startswith(through)
            ):
                return _Located((), PREFIX_MISMATCH, used_prefix_renders=True)
            start = len(before) + len(commonprefix([prompt[len(before) :], text[len(before) :]]))
            stops = list(self.special_tokens.finditer(text, start, len(through)))
            if not stops:
                return _Located((), PREFIX_MISMATCH, used_prefix_renders=True)
            stop = stops[-1]
            end = stop.end() + len(text[stop.end() : len(through)]) - len(text[stop.end() : len(through)].lstrip())
            turns.append(_CharTurn(index, start, stop.start(), end, stop.group()))
        if empty_turns == len(turns):
            return _Located((), EMPTY_ASSISTANT_TURNS, empty_turns, used_prefix_renders=True)
        return _Located(tuple(turns), KEPT, empty_turns, used_prefix_renders=True)

    # -- tokenizing -----------------------------------------------------------------------------

    def encode(self, texts: list[str]) -> list[Encoding]:
        backend = self.tokenizer.backend_tokenizer
        # A previous tokenizer(..., truncation=True / padding=...) call leaves its settings on the backend;
        # transformers resets them on every call, and so do we, or rows would come back cut or padded.
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        return backend.encode_batch(texts, add_special_tokens=False)


_maskers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _masker_for(tokenizer: PreTrainedTokenizerBase, tools: Any) -> _TemplateMasker:
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ValueError(
            f"{type(tokenizer).__name__} is not a fast (Rust) tokenizer, which assistant masking needs for "
            "character offsets; load the tokenizer with AutoTokenizer (use_fast=True)."
        )
    if tokenizer.chat_template is None:
        raise ValueError(
            "The tokenizer has no chat_template; set tokenizer.chat_template (e.g. from the model's "
            "chat_template.jinja) before masking conversations."
        )
    chat_template = tokenizer.get_chat_template(None, tools)
    by_template = _maskers.setdefault(tokenizer, {})
    if chat_template not in by_template:
        by_template[chat_template] = _TemplateMasker(tokenizer, chat_template)
    return by_template[chat_template]


def _normalized(conversation: Conversation, row: int
                ) -> tuple[Conversation, list[dict[str, Any]] | None, frozenset[int]]:
    """Messages as apply_chat_template sees them (None-valued keys dropped, tool calls as `tools.py` normalises
    them), checked for what we support; the row's own tools, carried on its first message; and the messages
    flagged out of the loss (``train: false`` or ``weight: 0``)."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError(f"Conversation {row} must be a non-empty list of messages, got {conversation!r:.80}.")
    normalized, tools, untrained = [], None, set()
    for position, message in enumerate(conversation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"Conversation {row} has a message without a string 'role': {message!r:.80}.")
        message = {key: value for key, value in message.items() if value is not None}
        if message.pop(TRAIN_FLAG, True) is False or message.pop(WEIGHT_FLAG, 1) == 0:
            untrained.add(position)
        message.pop(WEIGHT_FLAG, None)
        try:
            if position == 0 and TOOLS_FIELD in message:
                tools = parsed_tools(message.pop(TOOLS_FIELD))
            if message["role"] == "assistant" and "tool_calls" in message:
                message["tool_calls"] = parsed_tool_calls(message["tool_calls"])
                message.setdefault("content", "")  # Qwen3's template reads it
        except ToolDataError as error:
            raise ValueError(f"Conversation {row}: {error}; read tool rows with dataset_format: messages, "
                             "whose row rules drop such rows.") from error
        if message["role"] == "assistant":
            if not all(isinstance(message[field], str) for field in TEXT_FIELDS if field in message):
                raise ValueError(
                    f"Conversation {row} has an assistant message whose text fields are not strings "
                    f"({', '.join(f for f in TEXT_FIELDS if f in message)}); flatten them to strings first."
                )
        normalized.append(message)
    return normalized, tools, frozenset(untrained)


def _calls_tools(conversation: Conversation) -> bool:
    return any("tool_calls" in message for message in conversation)


_TOOL_PROBE = {"type": "function", "function": {"name": "probe_tool", "description": "\ue000probe\ue001",
                                                "parameters": {"type": "object", "properties": {}}}}


def check_renders_tools(tokenizer: PreTrainedTokenizerBase, **template_kwargs: Any) -> None:
    """ValueError unless the chat template renders a tool's definition and a call to it."""
    masker = _masker_for(tokenizer, [_TOOL_PROBE])
    key = ("renders_tools", _kwargs_key(template_kwargs))
    if key not in masker.tool_support:
        call = {"type": "function", "function": {"name": "probe_tool", "arguments": {"probe_argument": 1}}}
        conversation = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        try:
            rendered = masker._render([conversation], {**template_kwargs, "tools": [_TOOL_PROBE]})[0]
            masker.tool_support[key] = "\ue000probe\ue001" in rendered and "probe_argument" in rendered
        except TemplateError:
            masker.tool_support[key] = False
    if not masker.tool_support[key]:
        raise ValueError(
            "The chat template renders no tool definitions or no assistant tool_calls, so a tool-calling "
            "conversation would train calls the model is never shown how to make. Use a model whose tokenizer "
            "carries its own tool-calling chat template (chat_template.jinja beside it), or train only rows "
            "without tools and tool_calls."
        )


def _has_text(message: Message, fields: Sequence[str]) -> bool:
    """Whether any of ``fields`` holds more than whitespace (a blank reply is an empty one)."""
    return any(isinstance(_field_value(message, field), str) and _field_value(message, field).strip()
               for field in fields)


def _field_value(message: Message, field: str) -> Any:
    """A text field of a message, or (TOOL_CALL_FIELD) the function name of its last tool call."""
    if field == TOOL_CALL_FIELD:
        return message["tool_calls"][-1]["function"]["name"] if message.get("tool_calls") else None
    return message.get(field)


def _reasoning_moved_out_of_content(conversation: Conversation) -> Conversation | None:
    """The conversation with ``<think>...</think>`` in assistant contents moved to ``reasoning_content``.

    As Qwen3's template splits it (reasoning up to the first ``</think>``, answer after the last), so
    that a template splitting it out renders both forms alike (checked by the caller); None if no
    assistant content without a reasoning field holds ``</think>``.
    """
    moved, changed = [], False
    for message in conversation:
        content = message.get("content")
        if (
            message["role"] == "assistant"
            and isinstance(content, str)
            and "</think>" in content
            and not any(field in message for field in REASONING_FIELDS)
        ):
            reasoning = content.split("</think>")[0].split("<think>")[-1].strip("\n")
            message = {**message, "content": content.split("</think>")[-1].lstrip("\n"), "reasoning_content": reasoning}
            changed = True
        moved.append(message)
    return moved if changed else None


def _kwargs_key(template_kwargs: dict[str, Any]) -> str:
    return repr(sorted(template_kwargs.items()))


def _shape(conversation: Conversation) -> tuple:
    """What the template may branch on, apart from the text itself."""
    return tuple(
        (message["role"], tuple((key, _field_kind(key, value)) for key, value in message.items() if key != "role"))
        for message in conversation
    )


def _field_kind(key: str, value: Any) -> Any:
    if key in TEXT_FIELDS and isinstance(value, str):
        return "<text>" if value.strip() else "<blank>" if value else "<empty>"  # a blank reply is an empty one
    return ("=", value if isinstance(value, str) else repr(value))


def _sentinel(number: int) -> str:
    return f"\ue000{number}\ue001"


def _sentinel_probe(conversation: Conversation) -> tuple[Conversation, dict[int, tuple[int, str]]]:
    """The conversation with a numbered sentinel in every text field, and what each one stands for."""
    probe, slots = [], {}
    for index, message in enumerate(conversation):
        probed = {}
        for key, value in message.items():
            if key in TEXT_FIELDS and isinstance(value, str):
                slots[len(slots)] = (index, key)
                probed[key] = _sentinel(len(slots) - 1)
            else:
                probed[key] = value
        if message["role"] == "assistant" and message.get("tool_calls"):
            slots[len(slots)] = (index, TOOL_CALL_FIELD)
            *calls, last = message["tool_calls"]
            probed["tool_calls"] = [*calls, {**last, "function": {**last["function"], "name": _sentinel(len(slots) - 1)}}]
        probe.append(probed)
    return probe, slots


def _with_texts_emptied(probe: Conversation, fields: list[tuple[int, str]]) -> Conversation:
    emptied = [dict(message) for message in probe]
    for index, field in fields:
        emptied[index][field] = ""
    return emptied


def _without_sentinels(text: str, numbers: set[int]) -> str:
    return _SENTINEL.sub(lambda match: "" if int(match.group(1)) in numbers else match.group(0), text)


def _after(text: str, anchor: str | None) -> str | None:
    """The part of ``text`` after ``anchor`` (all of it for no anchor), None if the anchor is missing."""
    if anchor is None:
        return text
    position = text.rfind(anchor)
    return None if position < 0 else text[position + len(anchor) :]


def _segment_offsets(skeleton: _Skeleton, conversation: Conversation, text: str) -> list[int] | None:
    """Where each skeleton segment starts in ``text``, if ``text`` is the skeleton with the real texts in it."""
    segments = skeleton.segments
    if not text.startswith(segments[0]):
        return None
    offsets, position = [0], len(segments[0])
    for slot, (message_index, field) in enumerate(skeleton.slots):
        following = segments[slot + 1]
        value_end = _rendered_value_end(
            text, position, _field_value(conversation[message_index], field), following, is_last=slot == len(skeleton.slots) - 1
        )
        if value_end is None:
            return None
        offsets.append(value_end)
        position = value_end + len(following)
    return offsets if position == len(text) else None


def _rendered_value_end(text: str, position: int, value: str, following: str, is_last: bool) -> int | None:
    """End of ``value`` as rendered at ``position`` (verbatim or whitespace-trimmed), None if it is not there."""
    # tojson'd texts (Llama-3.1 and gpt-oss tool results) are rendered JSON-escaped between the quotes.
    for candidate in (value, value.strip(), json.dumps(value, ensure_ascii=False)[1:-1]):
        end = position + len(candidate)
        if text.startswith(candidate, position) and text.startswith(following, end):
            return end
    # Templates may trim one side or only newlines: accept any whitespace-trimmed form of the value.
    if is_last:
        end = len(text) - len(following)
    elif following:
        end = text.find(following, position)
    else:
        return None  # two adjacent texts with nothing between them cannot be told apart
    rendered = text[position:end] if end >= position else None
    if rendered is not None and rendered in value and rendered.strip() == value.strip():
        return end
    return None


# ---------------------------------------------------------------------------------------------
# Character spans -> token mask


def _masked(text: str, located: _Located, encoding: Encoding, max_length: int | None) -> MaskedConversation:
    input_ids = encoding.ids
    n_tokens = len(input_ids)
    kept_tokens = n_tokens if max_length is None else min(n_tokens, max_length)
    mask = bytearray(kept_tokens)
    turns = []
    for turn in located.turns:
        start = _first_token_from(encoding, turn.start, len(text), n_tokens)
        end = min(_first_token_from(encoding, turn.end, len(text), n_tokens), kept_tokens)
        if start >= end:
            assert kept_tokens < n_tokens, "untruncated, a turn covers at least its (atomic, special) stop token"
            continue  # cut off by truncation
        stop = _first_token_from(encoding, turn.stop, len(text), n_tokens)
        mask[start:end] = b"\x01" * (end - start)
        turns.append(SupervisedTurn(turn.message_index, start, end, turn.stop_token, stop < end))
    drop_reason = located.drop_reason
    if drop_reason == KEPT and not turns:
        drop_reason = TRUNCATED_AWAY
    if kept_tokens < n_tokens:
        input_ids = input_ids[:kept_tokens]
        text = text[: encoding.token_to_chars(kept_tokens - 1)[1]]
    return MaskedConversation(
        input_ids=input_ids,
        assistant_masks=list(mask),
        drop_reason=drop_reason,
        text=text,
        turns=tuple(turns),
        empty_turns=located.empty_turns,
        rerendered_turns=located.rerendered_turns,
        unrendered_reasoning_turns=located.unrendered_reasoning_turns,
        used_prefix_renders=located.used_prefix_renders,
        untrained_turns=located.untrained_turns,
    )


def _first_token_from(encoding: Encoding, char: int, text_length: int, n_tokens: int) -> int:
    """Index of the first token that starts at or after character ``char`` (n_tokens if none does)."""
    while char < text_length:
        token = encoding.char_to_token(char)
        if token is not None:
            # A token straddling ``char`` starts before it, so it belongs to the side before.
            return token if encoding.token_to_chars(token)[0] >= char else token + 1
        char += 1  # characters a normalizer dropped belong to no token
    return n_tokens
