"""The in-memory prompt dataset: rows, formats, tokenisation with truncation stats, and step batches.

A row is a dict with a required `prompt` (text for the *standard* format, a list of `{role, content}`
messages for the *conversational* format, as in TRL) and any other columns, which reach reward functions by
name. `PromptDataset.encode` tokenises every prompt once, before training, so over-long prompts are truncated
or dropped up front and counted (`EncodeStats`), and each step only looks token ids up.

Chat templates follow TRL: a conversational prompt goes through `tokenizer.apply_chat_template(...,
add_generation_prompt=True)`; a standard prompt is tokenised as plain text. To get the template on text
prompts, load them with `conversational=True` (see `load_prompt_dataset`): the format is decided once, at
load time, so reward functions see the same prompt the model saw.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from cohort.errors import ConfigError

Truncation = Literal["left", "drop"]


def is_conversational(prompt: Any) -> bool:
    """True for a list of `{role, content}` messages (TRL's conversational format)."""
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt
    )


def prompt_key(prompt: Any) -> str:
    """A hashable, canonical form of a prompt (text or messages), used to test eval/train disjointness."""
    if isinstance(prompt, str):
        return prompt
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False)


@dataclass
class EncodeStats:
    """What `PromptDataset.encode` did; the trainer logs `as_metrics()` once at start."""

    num_prompts: int = 0
    num_truncated: int = 0
    num_dropped: int = 0
    max_prompt_length: int | None = None
    longest_prompt_tokens: int = 0
    shortest_prompt_tokens: int | None = None  # with the longest: the range of encoded lengths, before truncation

    def as_metrics(self) -> dict[str, float]:
        return {
            "data/num_prompts": float(self.num_prompts),
            "data/prompts_truncated": float(self.num_truncated),
            "data/prompts_dropped": float(self.num_dropped),
            "data/longest_prompt_tokens": float(self.longest_prompt_tokens),
        }


@dataclass
class PromptBatch:
    """The prompts of one step: `prompts[i]`, their token ids, and every other column as lists."""

    prompts: list[Any]
    prompt_ids: list[list[int]] | None
    columns: dict[str, list[Any]]
    indices: list[int]

    def repeat(self, n: int) -> PromptBatch:
        """Each prompt (and its column values) `n` times in a row: the layout of n completions per prompt."""
        rep = lambda values: [v for v in values for _ in range(n)]  # noqa: E731
        return PromptBatch(
            prompts=rep(self.prompts),
            prompt_ids=None if self.prompt_ids is None else rep(self.prompt_ids),
            columns={k: rep(v) for k, v in self.columns.items()},
            indices=rep(self.indices),
        )


@dataclass
class PromptDataset(Sequence):
    """Rows with a `prompt` column; after `encode`, also `prompt_ids` (one token list per kept row)."""

    rows: list[dict[str, Any]]
    source: str = "<rows>"
    prompt_ids: list[list[int]] | None = None
    stats: EncodeStats = field(default_factory=EncodeStats)

    def __post_init__(self) -> None:
        for i, row in enumerate(self.rows):
            if "prompt" not in row:
                raise ConfigError(
                    f"Dataset {self.source!r}: row {i} has no 'prompt' (columns: {sorted(row)}). "
                    "Every row needs a prompt: text, or a list of {role, content} messages."
                )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows)

    @property
    def column_names(self) -> list[str]:
        """All columns, `prompt` first, in first-seen order."""
        names: dict[str, None] = {"prompt": None}
        for row in self.rows:
            names.update(dict.fromkeys(row))
        return list(names)

    @property
    def reward_columns(self) -> list[str]:
        """Columns passed to reward functions by name: every column except the prompt."""
        return [c for c in self.column_names if c != "prompt"]

    @property
    def is_conversational(self) -> bool:
        return bool(self.rows) and is_conversational(self.rows[0]["prompt"])

    def select(self, indices: Sequence[int]) -> PromptDataset:
        ids = None if self.prompt_ids is None else [self.prompt_ids[i] for i in indices]
        return PromptDataset([self.rows[i] for i in indices], self.source, ids, self.stats)

    def head(self, n: int) -> PromptDataset:
        """The first `n` rows (all of them when there are fewer)."""
        return self.select(range(min(n, len(self.rows))))

    def stats_line(self) -> str:
        """One line for the console: how many prompts encode truncated or dropped."""
        s = self.stats
        if self.prompt_ids is None:
            return "prompts not tokenised yet"
        limit = "no limit" if s.max_prompt_length is None else f"limit {s.max_prompt_length}"
        # the range of lengths shows at once when every prompt is over the limit (e.g. a tokenizer that cuts
        # text into single characters), and a truncated prompt lost its beginning, not its end
        cut = f" (kept their last {s.max_prompt_length} tokens)" if s.num_truncated else ""
        lengths = (f"longest {s.longest_prompt_tokens}" if s.shortest_prompt_tokens is None
                   else f"{s.shortest_prompt_tokens} to {s.longest_prompt_tokens}")
        return (
            f"prompt tokens: {lengths} ({limit}); "
            f"{s.num_truncated} truncated{cut}, {s.num_dropped} dropped of {s.num_prompts}"
        )

    def batch(self, indices: Sequence[int]) -> PromptBatch:
        """The prompts, token ids (if encoded) and reward columns of the rows at `indices`."""
        rows = [self.rows[i] for i in indices]
        columns = {c: [r.get(c) for r in rows] for c in self.reward_columns}
        ids = None if self.prompt_ids is None else [self.prompt_ids[i] for i in indices]
        return PromptBatch([r["prompt"] for r in rows], ids, columns, list(indices))

    def encode(
        self,
        tokenizer: Any,
        max_prompt_length: int | None = None,
        truncation: Truncation = "left",
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> PromptDataset:
        """Tokenise every prompt; return a new dataset with `prompt_ids` and `stats` set.

        truncation="left" keeps the last `max_prompt_length` tokens (TRL's `truncation_side="left"`: the end of
        the prompt, where the question and the generation prompt are, survives); "drop" removes the row.
        chat_template_kwargs: extra template variables (TRL's option of that name, e.g. enable_thinking).
        """
        if truncation not in ("left", "drop"):
            raise ConfigError(f"truncation={truncation!r} is not supported; use 'left' (keep the end) or 'drop'.")
        if max_prompt_length is not None and max_prompt_length < 1:
            raise ConfigError(f"max_prompt_length={max_prompt_length} must be >= 1 (or None for no limit).")
        stats = EncodeStats(num_prompts=len(self.rows), max_prompt_length=max_prompt_length)
        kept_rows: list[dict[str, Any]] = []
        kept_ids: list[list[int]] = []
        for i, row in enumerate(self.rows):
            ids = _tokenize_prompt(tokenizer, row["prompt"], self.source, i, dict(chat_template_kwargs or {}))
            stats.longest_prompt_tokens = max(stats.longest_prompt_tokens, len(ids))
            shortest = stats.shortest_prompt_tokens
            stats.shortest_prompt_tokens = len(ids) if shortest is None else min(shortest, len(ids))
            _keep(row, ids, max_prompt_length, truncation, stats, kept_rows, kept_ids)
        if not kept_rows:
            raise ConfigError(
                f"Dataset {self.source!r}: all {len(self.rows)} prompts are longer than max_prompt_length="
                f"{max_prompt_length} tokens (longest: {stats.longest_prompt_tokens}) and were dropped. "
                "Raise max_prompt_length or use truncation='left'."
            )
        return PromptDataset(kept_rows, self.source, kept_ids, stats)


    def fit(self, max_prompt_length: int, truncation: Truncation = "left") -> PromptDataset:
        """An encoded dataset whose prompts fit `max_prompt_length` tokens: longer ones truncated on the left or
        dropped, counted in `stats` (added to what `encode` counted). Used when the engine's context minus the
        completion length is tighter than the limit the prompts were encoded with."""
        if self.prompt_ids is None:
            raise ValueError("fit() needs an encoded dataset; call encode() first")
        if max_prompt_length < 1:
            raise ConfigError(f"max_prompt_length={max_prompt_length} must be >= 1.")
        if all(len(ids) <= max_prompt_length for ids in self.prompt_ids):
            return self
        s = self.stats
        stats = EncodeStats(num_prompts=s.num_prompts, num_truncated=s.num_truncated, num_dropped=s.num_dropped,
                            max_prompt_length=max_prompt_length, longest_prompt_tokens=s.longest_prompt_tokens,
                            shortest_prompt_tokens=s.shortest_prompt_tokens)
        kept_rows: list[dict[str, Any]] = []
        kept_ids: list[list[int]] = []
        for row, ids in zip(self.rows, self.prompt_ids, strict=True):
            _keep(row, ids, max_prompt_length, truncation, stats, kept_rows, kept_ids)
        if not kept_rows:
            raise ConfigError(
                f"Dataset {self.source!r}: all {len(self.rows)} prompts are longer than {max_prompt_length} tokens "
                f"(the context left beside the completion) and were dropped. Use data.truncation=left, raise "
                "generation.max_model_len or lower generation.max_completion_length."
            )
        return PromptDataset(kept_rows, self.source, kept_ids, stats)


def _keep(row, ids: list[int], max_len: int | None, truncation: Truncation, stats: EncodeStats,
          kept_rows: list, kept_ids: list) -> None:
    """Append the prompt, cut to its last `max_len` tokens or (truncation='drop') left out, and count which."""
    if max_len is not None and len(ids) > max_len:
        if truncation == "drop":
            stats.num_dropped += 1
            return
        ids = ids[-max_len:]
        stats.num_truncated += 1
    kept_rows.append(row)
    kept_ids.append(ids)


def _tokenize_prompt(tokenizer: Any, prompt: Any, source: str, index: int, template_kwargs: dict[str, Any]) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if not is_conversational(prompt):
        raise ConfigError(
            f"Dataset {source!r}: row {index} has a prompt of type {type(prompt).__name__}; a prompt must be "
            "text or a list of {'role': ..., 'content': ...} messages."
        )
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"Dataset {source!r} has conversational prompts but the tokenizer has no chat template. Set "
            "tokenizer.chat_template, or use text prompts (load them without conversational=True)."
        )
    try:
        out = tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=True, **template_kwargs
        )
    except Exception as exc:  # jinja2's TemplateError (raise_exception), UndefinedError, TypeError, ...
        raise ConfigError(_template_error(tokenizer, prompt, source, index, exc)) from None
    ids = out["input_ids"]
    # Some tokenizers return a batch of one for a single conversation.
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]


def _template_error(tokenizer: Any, prompt: list[Any], source: str, index: int, exc: Exception) -> str:
    """One line: the template (model.chat_template, else the tokenizer's own), the row, what it raised."""
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    roles = [str(m.get("role")) for m in prompt]
    reason = " ".join(f"{type(exc).__name__}: {exc}".split())
    if len(reason) > 300:
        reason = reason[:297] + "..."
    return (f"Dataset {source!r}: the chat template of {name!r} (model.chat_template when set, else the "
            f"tokenizer's own) raised on row {index} (roles {roles}, first message "
            f"{_excerpt(prompt[0].get('content'))}): {reason}. Fix the template, or the row's messages (e.g. "
            "drop data.system_prompt for a template without a system role).")


def _excerpt(value: Any, limit: int = 60) -> str:
    text = str(value).replace("\n", "\\n")
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")
