"""Why a raw row cannot be trained on: the drop reasons, and the rules the formats share.

Each dropped row is counted under the first reason that applies:

- `invalid_json`: a line of a local .jsonl file that is not a JSON object. Local .jsonl files are
  read line by line (`sources.py`), so one bad line is counted instead of failing the whole file
  (the `datasets` json loader rejects the file, and also any file whose column changes type).
- `not_utf8`: a line of a local .jsonl file that is not valid UTF-8 (e.g. `café` written in
  Latin-1). Decoding it anyway would train on U+FFFD replacement characters; a file that is mostly
  not UTF-8 is refused up front, naming the encoding it looks like (`sources.refuse_another_encoding`).
- `missing_field`, `not_a_string`, `empty_content`: a required field (alpaca `instruction` /
  `output`, `text`, `messages`, a message's `role` / `content`) is absent or null, is not a
  string, or is blank. `not_a_message_list`: a field that holds a conversation (`messages`, ShareGPT's
  `conversations`, `prompt_completion_chat`'s `prompt` and `completion`) is not a list of messages. alpaca `input` may be empty or absent, and
  so may a system / developer message's content. An assistant reply may be empty too: what an
  empty reply trains (its end of turn) and when a conversation of empty replies is dropped
  (`empty_assistant_turns`) is the masking's one rule (`masking.py`, "Empty replies"), the same
  for rows read up front, streamed rows and `--audit-data`.
- `unknown_role`: a message role outside KNOWN_ROLES. `no_assistant_turn`: nothing to learn from.
- `overlong`: longer than `max_length` tokens with `overlong_policy: drop`. With the default
  `truncate`, such rows keep their first `max_length` tokens and are counted as truncated; a row
  whose supervised tokens all fall past the cut is dropped (`no_trainable_tokens`; chat rows:
  `truncated_away`, the masking's name for it).
- tool conversations (`tools.py`): `invalid_tools` (the `tools` column is not a list of named schemas or a
  JSON string of one, or a tool's `parameters` are not a JSON object or a JSON string of one),
  `invalid_tool_call` (a call without a function name), `invalid_tool_arguments`
  (arguments that are not a JSON object or a JSON string of one), `unknown_tool` (a call to a tool the
  row's `tools` do not define), `orphan_tool_result` (a `role: tool` message that answers no call made
  before it). An assistant message with `tool_calls` may have no content. The masking adds
  `several_tool_calls` for a template that renders one call per message (`masking.py`).
- `messages_not_strings`, `strings_not_messages`: TRL's prompt/completion in the other of its two shapes
  (`prompt_completion` given message lists, `prompt_completion_chat` given strings); the refusal of a
  source dropped for them names the format that reads them (`REASON_FIXES`).
- `invalid_train_flag`: a message's `train` that is not a JSON true/false, or a `weight` other than the number 0
  or 1 (a message with `train: false` or `weight: 0` stays in the context and out of the loss; `masking.py`).
- vision_messages rows: `image_count_mismatch`, `misplaced_image`, `missing_image`, `unreadable_image`,
  `image_size` (see `vision.py`); an image conversation longer than a packed block is `overlong`.
"""

from __future__ import annotations

from typing import Any

INVALID_JSON = "invalid_json"
NOT_UTF8 = "not_utf8"
MISSING_FIELD = "missing_field"
NOT_A_STRING = "not_a_string"
NOT_A_MESSAGE_LIST = "not_a_message_list"
EMPTY_CONTENT = "empty_content"
UNKNOWN_ROLE = "unknown_role"
NO_ASSISTANT_TURN = "no_assistant_turn"
OVERLONG = "overlong"
NO_TRAINABLE_TOKENS = "no_trainable_tokens"
# tool conversations (`tools.py`)
INVALID_TOOLS = "invalid_tools"
INVALID_TOOL_CALL = "invalid_tool_call"
INVALID_TOOL_ARGUMENTS = "invalid_tool_arguments"
UNKNOWN_TOOL = "unknown_tool"
ORPHAN_TOOL_RESULT = "orphan_tool_result"
INVALID_TRAIN_FLAG = "invalid_train_flag"
# prompt/completion in the other of TRL's two shapes
MESSAGES_NOT_STRINGS = "messages_not_strings"
STRINGS_NOT_MESSAGES = "strings_not_messages"
# vision_messages rows (`vision.py`): image parts vs images, an image where it cannot be, the image files themselves.
IMAGE_COUNT_MISMATCH = "image_count_mismatch"
MISPLACED_IMAGE = "misplaced_image"
MISSING_IMAGE = "missing_image"
UNREADABLE_IMAGE = "unreadable_image"
IMAGE_SIZE = "image_size"
ROW_DROP_REASONS = (INVALID_JSON, NOT_UTF8, MISSING_FIELD, NOT_A_STRING, NOT_A_MESSAGE_LIST, EMPTY_CONTENT, UNKNOWN_ROLE, NO_ASSISTANT_TURN, OVERLONG,
                    NO_TRAINABLE_TOKENS, INVALID_TOOLS, INVALID_TOOL_CALL, INVALID_TOOL_ARGUMENTS, UNKNOWN_TOOL,
                    ORPHAN_TOOL_RESULT, INVALID_TRAIN_FLAG, MESSAGES_NOT_STRINGS, STRINGS_NOT_MESSAGES,
                    IMAGE_COUNT_MISMATCH, MISPLACED_IMAGE, MISSING_IMAGE, UNREADABLE_IMAGE,
                    IMAGE_SIZE)

# A reason that says which format reads the rows: a refusal of a source dropped for it ends with this fix.
REASON_FIXES = {
    MESSAGES_NOT_STRINGS: "prompt and completion are message lists: set dataset_format: prompt_completion_chat",
    STRINGS_NOT_MESSAGES: "prompt and completion are strings: set dataset_format: prompt_completion",
}

# A streamed dataset read for a packed block stream keeps its bad rows, each flagged with its drop
# reason in this column (None on good rows), so the reader that meets one counts it (`blocks.py`).
ROW_PROBLEM = "row_problem"

KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool")
# Roles whose content may be blank: an empty system prompt is a choice; an empty reply is the masking's to judge.
OPTIONAL_CONTENT_ROLES = ("system", "developer", "assistant")


def text_problem(value: Any, required: bool = True) -> str | None:
    if value is None:
        return MISSING_FIELD if required else None
    if not isinstance(value, str):
        return NOT_A_STRING
    if required and not value.strip():
        return EMPTY_CONTENT
    return None


def valid_train_flags(message: dict[str, Any]) -> bool:
    """`train` absent or a JSON boolean, `weight` absent or the number 0 or 1. Checked by type, not by Python's
    equality (0 == False, True == 1): the masking keeps only `train: false` out of the loss, so `train: 0` would
    train silently, and Arrow cannot store `false` in one row and `0` in another under the same key."""
    train, weight = message.get("train"), message.get("weight")
    return (train is None or isinstance(train, bool)) and (
        weight is None or (not isinstance(weight, bool) and weight in (0, 1)))


def messages_problem(messages: Any) -> str | None:
    if messages is None:
        return MISSING_FIELD
    if not isinstance(messages, list) or not all(isinstance(message, dict) for message in messages):
        return NOT_A_MESSAGE_LIST  # the conversation itself has the wrong type
    if not messages:
        return EMPTY_CONTENT
    for message in messages:
        problem = text_problem(message.get("role"))
        if problem:
            return problem
        if message["role"] not in KNOWN_ROLES:
            return UNKNOWN_ROLE
        if not valid_train_flags(message):
            return INVALID_TRAIN_FLAG
        if message["role"] == "assistant" and message.get("tool_calls") is not None and message.get("content") is None:
            continue  # a reply that only calls tools (the calls are checked by `tools.tool_problem`)
        # An empty question is a broken row; an empty system prompt or reply is not (OPTIONAL_CONTENT_ROLES).
        problem = text_problem(message.get("content"), required=message["role"] not in OPTIONAL_CONTENT_ROLES)
        if problem or message.get("content") is None:
            return problem or MISSING_FIELD
    if not any(message["role"] == "assistant" for message in messages):
        return NO_ASSISTANT_TURN
    return None
