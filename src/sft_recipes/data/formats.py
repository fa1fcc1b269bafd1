"""The dataset-format registry: each `dataset_format` is one object that owns its columns, its row
rules, how its rows become what SFTTrainer trains on, and the length policy, counted on that output.

- alpaca: the Llama seed's exact prompt as prompt/completion, tokenized exactly as TRL 1.16 tokenizes
  it (tested); completion-only loss;
- text: plain text, every token trained (tokenized as TRL does);
- prompt_completion: TRL's standard prompt/completion strings, tokenized as TRL does, loss on the completion;
- prompt_completion_chat: TRL's conversational prompt/completion (message lists), read as one conversation whose
  prompt replies are context only (`train: false`): the completion's assistant turns train, through the chat
  template, packable. Two names, not one, because a dataset's rows are one or the other (one Arrow type per
  column) and only conversations have a chat template, masks and packing;
- sharegpt: `conversations: [{from, value}]` (human/gpt/system/function_call/observation, a `system` and a
  `tools` column), LLaMA-Factory's ShareGPT, read as messages; other column, key and role names through the
  source's `mapping` (LLaMA-Factory's `columns`/`tags`, checked when the recipe is parsed);
- messages: chat conversations, rendered and tokenized once with assistant-only masks (`masking.py`),
  tool-calling ones included: assistant `tool_calls`, `role: tool` results and a `tools` column (`tools.py`).
  Tool rows are `messages` rows, not a format of their own, because that is TRL's conversational shape
  (a `tools` column beside `messages`) and tool datasets mix rows with and without calls in one file;
  a row with no tool content is read exactly as before;
- alpaca_chat: alpaca rows read as user/assistant conversations (the instruction, then its input, as the
  user turn; the output as the assistant turn), then trained exactly as messages: the model's chat
  template, assistant-only loss, packable. A mixture of alpaca and chat sources trains one prompt style;
- reasoning: messages whose assistant turns carry `thinking`, checked first to be trained;
- vision_messages: TRL's image + text chat shape, packed with each example's own mRoPE positions (`vision.py`).

`to_tokens` gives every format's rows one shape, `input_ids` + `labels`, so that sources in
different formats concatenate into one mixture (`mixture.py`; one dataset is a one-entry mixture);
SFTTrainer takes such rows as they are. Packed runs read chat conversations instead, and the block
stream tokenizes them (`blocks.py`).

Adding a format is adding one entry to `FORMATS`. The rows a format sees have passed its row rules
(`row_problem`, applied where the rows are read: `sources.py`).
"""

from __future__ import annotations

import difflib
import functools
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow.compute as pc
from datasets import Dataset, IterableDataset, Value
from transformers import PreTrainedTokenizerBase
from trl.data_utils import common_prefix_length

from sft_recipes.data.blocks import IGNORE_INDEX
from sft_recipes.data.masking import KEPT, TRUNCATED_AWAY, check_renders_tools, tokenize_conversations
from sft_recipes.data.report import DataReport
from sft_recipes.data.rows import (
    INVALID_TOOL_CALL,
    MESSAGES_NOT_STRINGS,
    MISSING_FIELD,
    NO_ASSISTANT_TURN,
    NO_TRAINABLE_TOKENS,
    NOT_A_MESSAGE_LIST,
    NOT_A_STRING,
    OVERLONG,
    STRINGS_NOT_MESSAGES,
    UNKNOWN_ROLE,
    messages_problem,
    text_problem,
)
from sft_recipes.data.tools import TOOLS_FIELD, has_tool_content, stored_conversation, tool_problem
from sft_recipes.errors import RecipeError

LENGTH_BATCH = 1000
MASKING_BATCH = 512


@dataclass(frozen=True)
class Tokenization:
    """How this run turns rows into tokens; decided once by the run (`sft_recipes.run`)."""

    max_length: int | None  # None: never cut (packed blocks split long conversations instead)
    overlong_policy: str = "truncate"  # rows over max_length: "truncate" (keep the first tokens) or "drop"
    completion_only_loss: bool | None = None  # TRL's: None means completion-only for prompt/completion
    template_kwargs: dict[str, Any] = field(default_factory=dict)


class DatasetFormat:
    name: str
    description: str
    required: frozenset[str]
    optional: frozenset[str] = frozenset()
    chat = False  # conversations with assistant-only masks: auditable and packable into blocks
    converts_to_messages = False  # rows become `messages` rows as they are read (`sources.py`): stored_row
    vision = False  # rows carry images: trained through the image block stream (`vision.py`)

    @property
    def columns(self) -> list[str]:
        """The columns a row of this format is read into (a stray column could break Arrow)."""
        return sorted(self.required | self.optional)

    def check_columns(self, column_names: list[str] | None, dataset_name: str) -> None:
        """RecipeError naming the missing columns and the ones the dataset has."""
        if column_names is None:  # some streamed datasets only know their columns after the first row
            return
        missing = sorted(self.required - set(column_names))
        if missing:
            raise RecipeError(
                f"Dataset {dataset_name!r} has no column(s) {missing} needed by dataset_format={self.name!r}; "
                f"it has {sorted(column_names)}. Pick the dataset_format that matches these columns "
                f"({', '.join(f'{name}: {sorted(fmt.required)}' for name, fmt in FORMATS.items())}) "
                "or rename the columns."
            )

    def row_problem(self, row: dict[str, Any]) -> str | None:
        """Why `row` cannot be trained on (a `rows.py` reason), or None when it can."""
        raise NotImplementedError

    def stored_row(self, row: dict[str, Any]) -> dict[str, Any]:
        """A good row of a local file as it is stored: the format's own columns only (a stray column whose type
        changes between rows would break Arrow)."""
        return {column: row.get(column) for column in self.columns}

    @property
    def stored_columns(self) -> list[str]:
        """The columns of a row as `stored_row` stores it."""
        return self.columns

    def with_mapping(self, mapping: dict[str, str]) -> DatasetFormat:
        """This format reading other column, key or role names (a source's `mapping`); only sharegpt has one."""
        raise RecipeError(f"dataset_format {self.name} takes no `mapping` (only sharegpt does): rename the columns "
                          "or remove `mapping`.")

    def mapping_problems(self, mapping: Any, where: str) -> list[str]:
        return [] if mapping is None else [f"{where}: dataset_format {self.name} takes no `mapping` (only sharegpt "
                                           "does): remove it, or rename the columns in the data"]

    def as_trained(self, rows: Dataset | IterableDataset) -> Dataset | IterableDataset:
        """The rows in the shape this format trains them, after its row rules and the held-out split (which
        therefore see the rows as read); most formats train them as read."""
        return rows

    def rows_to_train(self, rows: Dataset | IterableDataset, train_turns: str = "all") -> Dataset | IterableDataset:
        """`as_trained`, then (chat rows, `train_turns: last`) only each conversation's last reply in the loss."""
        rows = self.as_trained(rows)
        return last_turn_only(rows) if train_turns == "last" and self.chat else rows

    def check_trainable(self, rows, tokenizer: PreTrainedTokenizerBase, tokenization: Tokenization) -> None:
        """RecipeError when the rows, as this run tokenizes them, would not train what the format promises."""

    def to_tokens(self, rows: Dataset | IterableDataset, tokenizer: PreTrainedTokenizerBase,
                  tokenization: Tokenization, report: DataReport) -> Dataset | IterableDataset:
        """`input_ids` + `labels` rows (-100 where nothing is learned) after the length policy, cut to max_length;
        drops and supervised tokens go to `report`."""
        raise NotImplementedError


class _TokenizedAsTrl(DatasetFormat):
    """Prompt/completion and text formats, tokenized as TRL 1.16 tokenizes them (eos appended)."""

    def texts(self, rows: dict[str, list], eos: str) -> tuple[list[str], list[str] | None]:
        """(prompt + completion texts, prompt texts or None when there is no prompt) of a batch of rows."""
        raise NotImplementedError

    def _token_counts(self, rows: dict[str, list], tokenizer: PreTrainedTokenizerBase, tokenization: Tokenization
                      ) -> tuple[list[int], list[int]]:
        """(tokens, supervised tokens before truncation) per row."""
        texts, prompts = self.texts(rows, tokenizer.eos_token or "")
        lengths = [len(ids) for ids in tokenizer(texts)["input_ids"]]
        if prompts is None or tokenization.completion_only_loss is False:
            return lengths, lengths
        prompt_lengths = [len(ids) for ids in tokenizer(prompts)["input_ids"]]
        return lengths, [max(length - prompt, 0) for length, prompt in zip(lengths, prompt_lengths)]

    def to_tokens(self, rows, tokenizer, tokenization, report):
        """A map-style dataset: the length policy first, on counted tokens. A stream is tokenized as it is read
        and cut at max_length (keep_start, as TRL cuts a stream); it cannot be counted up front."""
        tokenize = functools.partial(self._tokens, tokenizer=tokenizer, tokenization=tokenization)
        if isinstance(rows, IterableDataset):
            return rows.map(tokenize, batched=True, batch_size=MASKING_BATCH,
                            remove_columns=rows.column_names or self.columns)
        if tokenization.max_length is not None:
            rows = self._apply_length_policy(rows, tokenizer, tokenization, report)
        return rows.map(tokenize, batched=True, batch_size=MASKING_BATCH, remove_columns=rows.column_names,
                        desc=f"Tokenizing {self.name} rows")

    def _tokens(self, rows: dict[str, list], tokenizer, tokenization: Tokenization) -> dict[str, list]:
        """As TRL 1.16 tokenizes: the full text, and the prompt alone; the completion starts where they
        diverge. keep_start truncation, as SFTTrainer's (the length policy dropped rows left without a target)."""
        texts, prompts = self.texts(rows, tokenizer.eos_token or "")
        full = tokenizer(texts)["input_ids"]
        masked = [0] * len(full)
        if prompts is not None and tokenization.completion_only_loss is not False:
            masked = [common_prefix_length(prompt, ids) for prompt, ids in zip(tokenizer(prompts)["input_ids"], full)]
        cut = tokenization.max_length
        return {"input_ids": [ids[:cut] for ids in full],
                "labels": [([IGNORE_INDEX] * start + ids[start:])[:cut] for start, ids in zip(masked, full)]}

    def _apply_length_policy(self, rows: Dataset, tokenizer, tokenization: Tokenization, report: DataReport) -> Dataset:
        max_length = tokenization.max_length
        keep, trainable = [], 0
        for start in range(0, len(rows), LENGTH_BATCH):
            lengths, supervised = self._token_counts(rows[start : start + LENGTH_BATCH], tokenizer, tokenization)
            for index, (length, targets) in enumerate(zip(lengths, supervised), start=start):
                if length > max_length and tokenization.overlong_policy == "drop":
                    report.drop(OVERLONG, f"row {index} ({length} tokens > max_length {max_length})", rows[index])
                    continue
                # keep_start truncation: the supervised tokens are the last `targets` of the row.
                left = max(min(length, max_length) - (length - targets), 0)
                if left == 0:
                    report.drop(NO_TRAINABLE_TOKENS, f"row {index} (every target past max_length {max_length})",
                                rows[index])
                    continue
                trainable += left - (left > 0 and targets == length)  # a labelled first token is no loss target
                report.truncated += length > max_length
                keep.append(index)
        report.kept_supervised_tokens = trainable
        return rows.select(keep) if len(keep) < len(rows) else rows


def alpaca_prompt(instruction: str, context: str | None) -> str:
    """The Llama seed's exact prompt (shared/seeds/000): optional Input block, Response header last."""
    prompt = f"### Instruction:\n{instruction}\n\n"
    if context:
        prompt += f"### Input:\n{context}\n\n"
    return prompt + "### Response:\n"


def alpaca_to_prompt_completion(row: dict[str, Any]) -> dict[str, str]:
    """One alpaca row as TRL prompt/completion; TRL appends eos to the completion, as the seed does.

    Keeping prompt and completion apart (instead of the seed's single string) is what lets the
    recipe choose completion-only loss without re-tokenising.
    """
    return {"prompt": alpaca_prompt(row["instruction"], row.get("input")), "completion": row["output"]}


def _with_eos(text: str, eos: str) -> str:
    return text if text.endswith(eos) else text + eos


class AlpacaFormat(_TokenizedAsTrl):
    name = "alpaca"
    description = "instruction/input/output, the Llama seed's prompt, completion-only loss"
    required = frozenset({"instruction", "output"})
    optional = frozenset({"input"})

    def row_problem(self, row):
        return (text_problem(row.get("instruction")) or text_problem(row.get("output"))
                or text_problem(row.get("input"), required=False))

    def texts(self, rows, eos):
        pairs = [alpaca_to_prompt_completion(dict(zip(rows, values))) for values in zip(*rows.values())]
        return ([p["prompt"] + _with_eos(p["completion"], eos) for p in pairs], [p["prompt"] for p in pairs])


class TextFormat(_TokenizedAsTrl):
    name = "text"
    description = "plain text, every token trained"
    required = frozenset({"text"})

    def row_problem(self, row):
        return text_problem(row.get("text"))

    def texts(self, rows, eos):
        return [_with_eos(text, eos) for text in rows["text"]], None


class ChatFormat(DatasetFormat):
    name = "messages"
    description = ("chat conversations (with tool_calls, tool results and a `tools` column where given), "
                   "assistant-only loss with the model's own chat template")
    required = frozenset({"messages"})
    optional = frozenset({TOOLS_FIELD})
    chat = True

    def row_problem(self, row):
        messages, tools = row.get("messages"), row.get(TOOLS_FIELD)
        return messages_problem(messages) or (tool_problem(messages, tools) if has_tool_content(messages, tools)
                                              else None)

    stored_columns = ["messages"]

    def stored_row(self, row):
        """A tool row with its calls and tools as JSON strings, the tools on its first message (`tools.py`)."""
        messages, tools = row.get("messages"), row.get(TOOLS_FIELD)
        return {"messages": stored_conversation(messages, tools) if has_tool_content(messages, tools) else messages}

    def as_trained(self, rows):
        """Rows read from the Hub as the local ones are stored: tool calls and tools as JSON, the tools moved
        onto the first message. Rows without a `tools` column or `tool_calls` field are trained as read."""
        present = rows.column_names
        fields = rows.features["messages"].feature if present is not None and rows.features else None
        if present is not None and TOOLS_FIELD not in present and not (
                isinstance(fields, dict) and "tool_calls" in fields and fields["tool_calls"] != Value("string")):
            return rows
        return rows.map(lambda row: ChatFormat.stored_row(self, row), remove_columns=[
            column for column in (TOOLS_FIELD,) if present is None or column in present])

    def check_trainable(self, rows, tokenizer, tokenization):
        self.check_tools_render(rows, tokenizer, tokenization)

    def check_tools_render(self, rows, tokenizer, tokenization):
        """A source with tool rows needs a template that renders tools and calls: refused up front otherwise."""
        if not _has_tool_rows(rows):
            return
        try:
            check_renders_tools(tokenizer, **tokenization.template_kwargs)
        except ValueError as error:
            raise RecipeError(f"This source has tool-calling rows. {error}") from None

    def prepare(self, rows, tokenizer, tokenization, report):
        """`input_ids` + `assistant_masks`: every conversation rendered and tokenized once, then the overlong
        ones cut or dropped on that output (a stream of conversations is packed instead: `check_data_sources`)."""
        assert isinstance(rows, Dataset), "streamed chat rows are read by the packed block stream"
        self.check_trainable(rows, tokenizer, tokenization)
        tokenized = rows.map(
            lambda batch: tokenize_conversations(tokenizer, batch["messages"], None, **tokenization.template_kwargs),
            batched=True, batch_size=MASKING_BATCH, remove_columns=rows.column_names,
            desc="Tokenizing conversations with assistant masks",
        )
        lengths = pc.list_value_length(tokenized.data.column("input_ids")).to_pylist()
        dropped, keep = Counter(), []
        max_length = tokenization.max_length
        for index, (length, reason) in enumerate(zip(lengths, tokenized["drop_reason"])):
            if reason != KEPT:
                dropped[reason] += 1
            elif max_length is not None and length > max_length and tokenization.overlong_policy == "drop":
                report.drop(OVERLONG, f"row {index} ({length} tokens > max_length {max_length})", rows[index])
            else:
                keep.append(index)
        kept = tokenized.select(keep)
        if max_length is not None and any(lengths[index] > max_length for index in keep):
            kept = kept.map(lambda batch: _truncated(batch, max_length), batched=True, desc="Truncating")
            cut_away = kept["drop_reason"].count(TRUNCATED_AWAY)
            report.truncated += sum(lengths[index] > max_length for index in keep) - cut_away
            if cut_away:
                dropped[TRUNCATED_AWAY] += cut_away
                kept = kept.filter(lambda reasons: [r == KEPT for r in reasons], input_columns="drop_reason",
                                   batched=True)
        kept = kept.remove_columns("drop_reason")
        report.count_masking(dict(dropped), supervised_tokens(kept))
        return kept

    def to_tokens(self, rows, tokenizer, tokenization, report):
        return self.prepare(rows, tokenizer, tokenization, report).map(
            lambda batch: {"labels": [[token if keep else IGNORE_INDEX for token, keep in zip(ids, mask)]
                                      for ids, mask in zip(batch["input_ids"], batch["assistant_masks"])]},
            batched=True, remove_columns=["assistant_masks"], desc="Labels from assistant masks",
        )


def alpaca_conversation(instruction: str | None, context: str | None, output: str | None) -> list[dict[str, str]]:
    """One alpaca row as a user/assistant conversation: the input, when there is one, follows the instruction
    after a blank line. A row flagged bad by its row rules (values None) becomes no conversation."""
    if instruction is None or output is None:
        return []
    question = instruction + (f"\n\n{context}" if context else "")
    return [{"role": "user", "content": question}, {"role": "assistant", "content": output}]


class AlpacaChatFormat(ChatFormat):
    name = "alpaca_chat"
    description = "instruction/input/output as a user/assistant conversation: chat template, assistant-only loss"
    required = AlpacaFormat.required
    optional = AlpacaFormat.optional
    stored_row = DatasetFormat.stored_row
    stored_columns = DatasetFormat.stored_columns

    def row_problem(self, row):
        return AlpacaFormat.row_problem(self, row)

    def as_trained(self, rows):
        def conversations(batch: dict[str, list]) -> dict[str, list]:
            contexts = batch.get("input") or [None] * len(batch["instruction"])
            return {"messages": [alpaca_conversation(*values)
                                 for values in zip(batch["instruction"], contexts, batch["output"])]}

        present = rows.column_names  # None: a stream that knows its columns only from its rows (all of ours)
        return rows.map(conversations, batched=True,
                        remove_columns=[c for c in self.columns if present is None or c in present])


class ReasoningFormat(ChatFormat):
    name = "reasoning"
    description = "chat whose assistant turns carry `thinking`, checked to be trained"

    def check_trainable(self, rows, tokenizer, tokenization):
        from sft_recipes.data.reasoning import check_reasoning_is_trained

        super().check_trainable(rows, tokenizer, tokenization)
        check_reasoning_is_trained(rows, tokenizer, **tokenization.template_kwargs)


class PromptCompletionFormat(_TokenizedAsTrl):
    name = "prompt_completion"
    description = "TRL's prompt/completion strings, loss on the completion (completion_only_loss: false: all)"
    required = frozenset({"prompt", "completion"})

    def row_problem(self, row):
        if any(isinstance(value, list) and value and all(isinstance(message, dict) for message in value)
               for value in (row.get("prompt"), row.get("completion"))):
            return MESSAGES_NOT_STRINGS  # conversational: prompt_completion_chat reads them
        return text_problem(row.get("prompt"), required=False) or text_problem(row.get("completion"))

    def texts(self, rows, eos):
        return ([(prompt or "") + _with_eos(completion, eos) for prompt, completion in zip(rows["prompt"],
                                                                                          rows["completion"])],
                [prompt or "" for prompt in rows["prompt"]])


class _ConvertedChat(ChatFormat):
    """A chat shape read as `messages` rows as it is read (`converts_to_messages`): its own row rules on the
    source's columns, then the messages rules on the conversation it becomes."""

    converts_to_messages = True

    def conversation(self, row: dict[str, Any]) -> dict[str, Any] | str:
        """`{messages, tools}` of a row, or the drop reason that stops it from being one."""
        raise NotImplementedError

    def row_problem(self, row):
        chat = self.conversation(row)
        return chat if isinstance(chat, str) else ChatFormat.row_problem(self, chat)

    def stored_row(self, row):
        return ChatFormat.stored_row(self, self.conversation(row))

    def as_trained(self, rows):
        return ChatFormat.as_trained(self, rows)  # read as messages already (`sources.py`)


class PromptCompletionChatFormat(_ConvertedChat):
    name = "prompt_completion_chat"
    description = ("TRL's conversational prompt/completion (message lists): the completion's assistant turns trained "
                   "through the chat template, the prompt's replies context only; packable")
    required = frozenset({"prompt", "completion"})
    optional = frozenset({TOOLS_FIELD})

    def conversation(self, row):
        prompt, completion = row.get("prompt"), row.get("completion")
        if prompt is None or completion is None:
            return MISSING_FIELD
        if isinstance(prompt, str) and isinstance(completion, str):
            return STRINGS_NOT_MESSAGES  # dataset_format: prompt_completion reads them
        if not isinstance(prompt, list) or not isinstance(completion, list):
            return NOT_A_MESSAGE_LIST  # one list and one string: neither format reads the row
        if not any(isinstance(message, dict) and message.get("role") == "assistant" for message in completion):
            return NO_ASSISTANT_TURN
        context = [{**message, "train": False} if isinstance(message, dict) and message.get("role") == "assistant"
                   else message for message in prompt]
        return {"messages": context + completion, TOOLS_FIELD: row.get(TOOLS_FIELD)}


SHAREGPT_DEFAULTS = {  # LLaMA-Factory's dataset_info.json names: columns, then tags
    "messages": "conversations", "system": "system", "tools": "tools",
    "role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
    "system_tag": "system", "function_tag": "function_call", "observation_tag": "observation",
}


class ShareGptFormat(_ConvertedChat):
    """ShareGPT rows (LLaMA-Factory's function-calling shape included): a `function_call` message is an assistant
    message whose value is the call(s) as JSON (`{name, arguments}` or a list of them), an `observation` a tool
    result; the `tools` column is a JSON string of schemas."""

    name = "sharegpt"
    description = ("ShareGPT conversations: [{from, value}] (human/gpt/system/function_call/observation), system and "
                   "tools columns; other names through the source's `mapping`")

    def __init__(self, mapping: dict[str, str] | None = None):
        self.names = {**SHAREGPT_DEFAULTS, **(mapping or {})}
        self.required = frozenset({self.names["messages"]})
        self.optional = frozenset({self.names["system"], self.names["tools"]})
        self.roles = {self.names["user_tag"]: "user", self.names["assistant_tag"]: "assistant",
                      self.names["system_tag"]: "system", self.names["function_tag"]: "function_call",
                      self.names["observation_tag"]: "tool"}

    def with_mapping(self, mapping):
        return ShareGptFormat(mapping)

    def mapping_problems(self, mapping, where):
        if mapping is None:
            return []
        if not isinstance(mapping, dict):
            return [f"{where}: mapping must be a mapping such as {{messages: conversations, user_tag: human}}"]
        problems = []
        for key, value in mapping.items():
            if key not in SHAREGPT_DEFAULTS:
                close = difflib.get_close_matches(str(key), SHAREGPT_DEFAULTS, n=2, cutoff=0.6)
                problems.append(f"{where}: mapping has no key {key!r}" + (
                    f"; did you mean {', '.join(map(repr, close))}?" if close
                    else f" (keys: {', '.join(SHAREGPT_DEFAULTS)})"))
            elif not isinstance(value, str) or not value:
                problems.append(f"{where}: mapping.{key} must be a name (a string), got {value!r}")
        names = {**SHAREGPT_DEFAULTS, **{k: v for k, v in mapping.items() if k in SHAREGPT_DEFAULTS}}
        tags = [names[key] for key in SHAREGPT_DEFAULTS if key.endswith("_tag") and key not in ("role_tag",
                                                                                                  "content_tag")]
        if len(set(tags)) < len(tags):
            problems.append(f"{where}: two roles are mapped to the same tag ({tags}): give each role its own tag")
        return problems

    def conversation(self, row):
        names = self.names
        turns = row.get(names["messages"])
        if turns is None:
            return MISSING_FIELD
        if not isinstance(turns, list) or not all(isinstance(turn, dict) for turn in turns):
            return NOT_A_MESSAGE_LIST
        messages = []
        system = row.get(names["system"])
        if system is not None:
            if not isinstance(system, str):
                return NOT_A_STRING
            if system:
                messages.append({"role": "system", "content": system})
        for turn in turns:
            role = self.roles.get(turn.get(names["role_tag"]))
            value = turn.get(names["content_tag"])
            if role is None:
                return UNKNOWN_ROLE if turn.get(names["role_tag"]) is not None else MISSING_FIELD
            if role == "function_call":
                try:
                    calls = json.loads(value) if isinstance(value, str) else value
                except json.JSONDecodeError:
                    return INVALID_TOOL_CALL
                calls = calls if isinstance(calls, list) else [calls]
                messages.append({"role": "assistant", "content": None, "tool_calls": calls})
            else:
                messages.append({"role": role, "content": value})
        return {"messages": messages, TOOLS_FIELD: row.get(names["tools"])}


class VisionMessagesFormat(ChatFormat):
    """TRL's image + text shape; rows are stored flat (string contents with image placeholders, `vision.py`), so
    that they concatenate with text chat sources, and train only through the image block stream."""

    name = "vision_messages"
    description = ("chat with image parts ({type: image} / {type: text}) and an `images` column, assistant-only loss, "
                   "packed with per-example mRoPE positions (pack_blocks: true)")
    required = frozenset({"messages", "images"})
    vision = True

    def row_problem(self, row):
        from sft_recipes.data.vision import vision_row_problem

        return vision_row_problem(row)

    def stored_row(self, row):
        from sft_recipes.data.vision import flatten_parts

        return {"messages": flatten_parts(row["messages"])[0], "images": row.get("images") or []}

    def to_tokens(self, rows, tokenizer, tokenization, report):
        raise RecipeError("dataset_format vision_messages trains through the image block stream: set "
                          "pack_blocks: true (TRL's own pipeline neither packs nor masks image rows).")


def last_turn_only(rows: Dataset | IterableDataset) -> Dataset | IterableDataset:
    """`train_turns: last`: every assistant message but each conversation's last one flagged `train: false`
    (kept as context, out of the loss: `masking.py`)."""
    def flagged(row: dict[str, Any]) -> dict[str, Any]:
        messages = row["messages"]
        last = max((index for index, message in enumerate(messages) if message["role"] == "assistant"), default=-1)
        return {"messages": [{**message, "train": False} if message["role"] == "assistant" and index != last
                             else message for index, message in enumerate(messages)]}

    return rows.map(flagged)


def _has_tool_rows(rows: Dataset | IterableDataset) -> bool:
    """Whether any conversation carries tools or tool calls (a stream: any of its first 1000), read in Arrow."""
    if isinstance(rows, IterableDataset):
        return any(has_tool_content(row["messages"], row["messages"][0].get(TOOLS_FIELD) if row["messages"] else None)
                   for row in rows.take(1000))
    fields = rows.features["messages"].feature
    if not isinstance(fields, dict):
        return False
    messages = pc.list_flatten(rows.data.column("messages"))
    return any(pc.any(pc.is_valid(pc.struct_field(messages, [name]))).as_py()
               for name in (TOOLS_FIELD, "tool_calls") if name in fields)


def _truncated(batch: dict[str, list], max_length: int) -> dict[str, list]:
    """Keep the first `max_length` tokens and their mask bits; a row left with no target is `truncated_away`."""
    ids = [row[:max_length] for row in batch["input_ids"]]
    masks = [row[:max_length] for row in batch["assistant_masks"]]
    reasons = [reason if any(mask) else TRUNCATED_AWAY for reason, mask in zip(batch["drop_reason"], masks)]
    return {"input_ids": ids, "assistant_masks": masks, "drop_reason": reasons}


def supervised_tokens(dataset: Dataset) -> int:
    """The loss's targets: `assistant_masks` summed after each row's first token (nothing predicts it), in Arrow:
    no token goes through Python."""
    batches = dataset.with_format("arrow").iter(batch_size=10_000)
    return sum(pc.sum(pc.list_flatten(pc.list_slice(batch.column("assistant_masks"), 1))).as_py() or 0
               for batch in batches)


FORMATS: dict[str, DatasetFormat] = {fmt.name: fmt for fmt in
                                     (AlpacaFormat(), AlpacaChatFormat(), ChatFormat(), ReasoningFormat(), TextFormat(),
                                      PromptCompletionFormat(), PromptCompletionChatFormat(), ShareGptFormat(),
                                      VisionMessagesFormat())}
CHAT_FORMATS = tuple(name for name, fmt in FORMATS.items() if fmt.chat)
