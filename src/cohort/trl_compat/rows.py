"""Datasets into prompt rows for `GRPOTrainer`: a `datasets` Dataset, DatasetDict or IterableDataset, a list of
dicts, or a dict of columns becomes a list of row dicts (None for a streaming train set, drawn from lazily).
"""

from __future__ import annotations

from typing import Any

from cohort.errors import ConfigError


class GivenRows:
    """The facade's `data.source`: the rows GRPOTrainer was given (a callable returning them, which the config
    checks accept without any data package). Never copied: the config's to_dict deep-copies its values."""

    def __init__(self, rows: list[dict]):
        self.rows = rows
        self.__name__ = "train_dataset"

    def __call__(self) -> list[dict]:
        return self.rows

    def __deepcopy__(self, memo) -> GivenRows:
        return self


def is_row(obj) -> bool:
    """A single prompt row (a dict with 'prompt'), as opposed to a dict of columns or of splits."""
    return isinstance(obj, dict) and "prompt" in obj


def first_split(data):
    """The first split of a dict of splits (a DatasetDict); anything else as it is."""
    if isinstance(data, dict) and not is_row(data):
        return next(iter(data.values()))
    return data


def prompt_rows(data: Any, args, what: str) -> list[dict] | None:
    """Prompt rows of a `datasets` Dataset, a list of dicts, or a column dict; None for a streaming dataset
    (IterableDataset), which needs max_steps as in TRL."""
    try:
        # optional dependency (the data extra: Hugging Face datasets)
        from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict
    except ImportError:  # without datasets, rows and column dicts still work: no object is one of these types
        Dataset = DatasetDict = IterableDataset = IterableDatasetDict = ()
    if isinstance(data, (DatasetDict, IterableDatasetDict)):  # tuples: () (no datasets) is a valid empty one
        if what == "train_dataset":
            raise ConfigError(f"{what} is a DatasetDict with splits {list(data)}; pass one split, e.g. "
                              f"{what}=dataset['train'].")
        data = next(iter(data.values()))
    if isinstance(data, IterableDataset):
        if what == "train_dataset":
            if args.max_steps <= 0:
                raise ConfigError("train_dataset is an IterableDataset (streaming), which has no length: set "
                                  "GRPOConfig(max_steps=...), as TRL requires.")
            return None
        return [dict(r) for r in data]
    if isinstance(data, Dataset):
        return data.to_list()
    if isinstance(data, dict):  # columns ({"prompt": [...], ...}): a dataset is never a single row
        keys = list(data)
        return [dict(zip(keys, values)) for values in zip(*data.values())]
    return [dict(r) for r in data]
