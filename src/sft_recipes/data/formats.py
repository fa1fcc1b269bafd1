"""Row schemas -> the shapes SFTTrainer trains on.

Each format names the columns it needs so a wrong dataset fails before any model loads, and turns
one raw row into TRL's prompt/completion or text form.
"""

from __future__ import annotations

from typing import Any

# Formats trained as chat conversations with assistant-only masks.
CHAT_FORMATS = ("messages", "reasoning")

# Columns each format reads; the first group must exist, the second may.
REQUIRED_COLUMNS: dict[str, tuple[set[str], set[str]]] = {
    "alpaca": ({"instruction", "output"}, {"input"}),
    "messages": ({"messages"}, set()),
    "reasoning": ({"messages"}, set()),  # messages whose assistant turns carry `thinking`
    "text": ({"text"}, set()),
}


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


def check_columns(column_names: list[str] | None, dataset_format: str, dataset_name: str) -> None:
    """ValueError naming the missing columns and the ones the dataset has."""
    if column_names is None:  # some streamed datasets only know their columns after the first row
        return
    required, _ = REQUIRED_COLUMNS[dataset_format]
    missing = sorted(required - set(column_names))
    if missing:
        raise ValueError(
            f"Dataset {dataset_name!r} has no column(s) {missing} needed by dataset_format={dataset_format!r}; "
            f"it has {sorted(column_names)}. Pick the dataset_format that matches these columns "
            f"({', '.join(f'{k}: {sorted(v[0])}' for k, v in REQUIRED_COLUMNS.items())}) or rename the columns."
        )
