"""Raw rows -> the dataset handed to SFTTrainer, per `dataset_format`."""

from __future__ import annotations

from datasets import Dataset, IterableDataset

from sft_recipes.data.formats import alpaca_to_prompt_completion


def prepare_train_dataset(raw: Dataset | IterableDataset, data_args, tokenizer) -> Dataset | IterableDataset:
    if data_args.dataset_format == "alpaca":
        return raw.map(alpaca_to_prompt_completion, remove_columns=raw.column_names)
    if data_args.dataset_format == "text":
        return raw
    return raw.select_columns(["messages"])
