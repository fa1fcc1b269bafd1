"""Open a recipe's dataset from the Hub or a local file/folder, the same way for both."""

from __future__ import annotations

from pathlib import Path

from datasets import Dataset, IterableDataset, load_dataset

LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_raw_dataset(data_args) -> Dataset | IterableDataset:
    """The training split named by `DataArguments`, streamed when the recipe asks for it."""
    name = data_args.dataset_name
    if not name:
        raise ValueError("The recipe has no dataset_name: give a Hub dataset id or a local .jsonl/.parquet/.csv path.")
    split = data_args.dataset_train_split
    path = Path(name)
    if path.is_file():
        builder = LOCAL_BUILDERS.get(path.suffix)
        if builder is None:
            raise ValueError(f"Cannot read {path}: use one of {sorted(LOCAL_BUILDERS)}.")
        dataset = load_dataset(builder, data_files={split: str(path)}, split=split, streaming=data_args.dataset_streaming)
    elif path.is_dir():
        dataset = load_dataset(str(path), split=split, streaming=data_args.dataset_streaming)
    elif name.startswith((".", "/")) or path.suffix in LOCAL_BUILDERS:
        raise ValueError(f"Dataset file not found: {path} (dataset_name). Check the path relative to {Path.cwd()}.")
    else:
        dataset = load_dataset(
            name,
            data_args.dataset_config,
            split=split,
            revision=data_args.dataset_revision,
            streaming=data_args.dataset_streaming,
        )
    if data_args.max_train_samples is not None:
        if isinstance(dataset, IterableDataset):
            dataset = dataset.take(data_args.max_train_samples)
        else:
            dataset = dataset.select(range(min(data_args.max_train_samples, len(dataset))))
    return dataset
