"""Which prompts each step sees: a seeded, resumable order, and held-out splits disjoint from training.

`PromptSampler` walks a permutation of the rows (reshuffled every epoch with `seed + epoch`), handing out
`prompts_per_step` indices per step; a step that crosses an epoch boundary takes the rest of one epoch and
the start of the next. Its state is just (epoch, position), so a resumed run sees exactly the same prompts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from cohort.data.dataset import PromptDataset, prompt_key
from cohort.data.images import images_key  # rows with the same text over different images differ
from cohort.data.sources import load_prompt_dataset
from cohort.errors import ConfigError


class PromptSampler:
    """Indices of the prompts for each step, epoch after epoch, reproducible from (seed, epoch, position)."""

    def __init__(self, num_rows: int, prompts_per_step: int, seed: int = 0, shuffle: bool = True):
        if num_rows < 1:
            raise ConfigError(f"PromptSampler: num_rows={num_rows}; the dataset has no prompts.")
        if prompts_per_step < 1:
            raise ConfigError(f"PromptSampler: prompts_per_step={prompts_per_step} must be >= 1.")
        self.num_rows = num_rows
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # how many indices of the current epoch's order were already handed out
        self._order: list[int] | None = None

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(self.num_rows, generator=g).tolist()
            else:
                self._order = list(range(self.num_rows))
        return self._order

    def next_indices(self) -> list[int]:
        """The next step's `prompts_per_step` row indices."""
        return self.take(self.prompts_per_step)

    def take(self, count: int) -> list[int]:
        """The next `count` indices of the order (dynamic sampling asks for a step's missing prompts)."""
        out: list[int] = []
        while len(out) < count:
            order = self._epoch_order()
            take = min(count - len(out), self.num_rows - self.position)
            out.extend(order[self.position : self.position + take])
            self.position += take
            if self.position == self.num_rows:
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
        return out

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_indices()

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_rows": self.num_rows,
            "prompts_per_step": self.prompts_per_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_rows", self.num_rows) != self.num_rows:
            raise ConfigError(
                f"Cannot resume the prompt order: the checkpoint saw {state['num_rows']} prompts, the dataset now "
                f"has {self.num_rows}. Resume with the same data, max_prompt_length and truncation settings."
            )
        self.seed = int(state.get("seed", self.seed))
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None


def train_eval_split(dataset: PromptDataset, eval_size: int | float, seed: int = 0) -> tuple[PromptDataset, PromptDataset]:
    """A random held-out split; training rows whose prompt also occurs in eval are removed from training.

    eval_size: a count, or a fraction of the rows when < 1. Removing duplicates guarantees that no eval
    prompt text is ever trained on, even when the source repeats prompts.
    """
    n = len(dataset)
    k = round(eval_size * n) if isinstance(eval_size, float) and eval_size < 1 else int(eval_size)
    if not 0 < k < n:
        raise ConfigError(
            f"eval_size={eval_size} gives {k} eval rows out of {n}; it must leave at least one row on each side."
        )
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    eval_ds = dataset.select(sorted(perm[:k]))
    train_ds, _ = drop_overlap(dataset.select(sorted(perm[k:])), eval_ds)
    return train_ds, eval_ds


def drop_overlap(dataset: PromptDataset, reference: PromptDataset) -> tuple[PromptDataset, int]:
    """`dataset` without the rows whose prompt also occurs in `reference`, and how many were removed.

    Use it to keep a held-out set's problems out of training: `train_ds, n = drop_overlap(train_ds, eval_ds)`.
    """

    seen = {(prompt_key(r["prompt"]), images_key(r)) for r in reference.rows}
    keep = [i for i, r in enumerate(dataset.rows) if (prompt_key(r["prompt"]), images_key(r)) not in seen]
    if not keep:
        raise ConfigError(
            f"Every prompt of {dataset.source!r} also occurs in {reference.source!r}; nothing would be left. "
            "Generate the eval set with harder settings or a seed far from the training one: reasoning-gym "
            "item i of seed s is item i + 1 of seed s - 1, so use reasoning_gym_eval_set()."
        )
    return dataset.select(keep), len(dataset) - len(keep)


def reasoning_gym_eval_set(
    task: str, size: int, train: PromptDataset, *, train_seed: int, **settings: Any
) -> tuple[PromptDataset, PromptDataset, int]:
    """(held-out problems, the training set without them, how many training rows were removed).

    reasoning-gym seeds item i with `seed + i`, so datasets from nearby seeds share almost every item
    (seed 2's item 0 is seed 1's item 1). The eval seed therefore starts right after the last training
    item's seed. The held-out draw is kept whole, an unbiased sample of the task, and training rows that
    coincide with a held-out problem by value are removed from training. (Dropping them from the held-out
    set instead would keep only the problems training happened to miss: in a small problem space, the
    rarer and harder ones, which biases the held-out accuracy down.)
    `settings` are the task's config and the same prompt options as `load_prompt_dataset`.
    """
    last = max((r.get("metadata") or {}).get("source_index", -1) for r in train.rows)
    seed = train_seed + max(last + 1, len(train))
    held = load_prompt_dataset(f"reasoning_gym:{task}", size=size, seed=seed, **settings)
    train, removed = drop_overlap(train, held)
    return held, train, removed
