"""Reasoning datasets (HuggingFaceH4/Multilingual-Thinking): check the reasoning is really trained.

Rows are chat ``messages`` whose assistant turns carry their reasoning beside the answer
(``thinking``; transformers treats ``reasoning_content`` and ``reasoning`` as the same field).
The chat template decides where reasoning goes (GPT-OSS: an ``analysis`` channel message before
the ``final`` one) and whether it is rendered at all (most templates drop it from earlier turns,
some never render it). Masking supervises whatever the template renders in an assistant turn, so
a template that ignores the field would train on answers only, silently. `check_reasoning_is_trained`
proves on a sample of rows that each last reasoning lands inside the supervised tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice
from typing import Any

from transformers import PreTrainedTokenizerBase

from sft_recipes.data.masking import KEPT, REASONING_FIELDS, mask_conversations
from sft_recipes.errors import RecipeError

SAMPLE_ROWS = 64


def reasoning_of(message: dict[str, Any]) -> str | None:
    """The reasoning text of one message, whichever of the aliased fields carries it."""
    return next((message[key] for key in REASONING_FIELDS if isinstance(message.get(key), str) and message[key]), None)


def last_reasoning(conversation: list[dict[str, Any]]) -> str | None:
    """Reasoning of the last assistant turn: the one every template renders when it renders any."""
    assistant_turns = [message for message in conversation if message["role"] == "assistant"]
    return reasoning_of(assistant_turns[-1]) if assistant_turns else None


def supervised_text(tokenizer: PreTrainedTokenizerBase, input_ids: list[int], assistant_masks: list[int]) -> str:
    """The text of the tokens in the loss (turns joined; each turn is a contiguous run of tokens)."""
    supervised = [token for token, bit in zip(input_ids, assistant_masks) if bit]
    return tokenizer.decode(supervised, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def check_reasoning_is_trained(
    rows: Iterable[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    messages_field: str = "messages",
    sample_rows: int = SAMPLE_ROWS,
    **template_kwargs: Any,
) -> int:
    """ValueError unless, in the first `sample_rows` rows, every last reasoning is rendered into the loss.

    Returns the number of rows checked. Rows without any reasoning are an error too: the recipe said
    `dataset_format: reasoning`, so a dataset without reasoning is the wrong dataset.
    """
    conversations = [row[messages_field] for row in islice(iter(rows), sample_rows)]
    without = [index for index, conversation in enumerate(conversations) if last_reasoning(conversation) is None]
    if without:
        raise RecipeError(
            f"dataset_format: reasoning needs the last assistant turn of every row to carry its reasoning in "
            f"`thinking` (or `reasoning_content`/`reasoning`); rows {without[:5]} of the first {len(conversations)} "
            "have none. Use dataset_format: messages for plain chat data."
        )
    masked = mask_conversations(tokenizer, conversations, None, **template_kwargs)
    untrained = [
        index
        for index, (conversation, row) in enumerate(zip(conversations, masked))
        if row.drop_reason != KEPT
        or last_reasoning(conversation).strip() not in supervised_text(tokenizer, row.input_ids, row.assistant_masks)
    ]
    if untrained:
        raise RecipeError(
            f"The chat template does not put the assistant's reasoning into the trained tokens for {len(untrained)} of "
            f"{len(conversations)} sampled rows (e.g. row {untrained[0]}): the model would learn answers without "
            "reasoning. Use the model's own chat template (GPT-OSS renders `thinking` as the analysis channel of the "
            "last assistant turn), or dataset_format: messages to train on answers only on purpose."
        )
    return len(conversations)
