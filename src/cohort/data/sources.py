"""Where prompts come from: local files, Hugging Face `datasets`, reasoning-gym tasks, Python callables.

`load_prompt_dataset(source, ...)` turns any of them into a `PromptDataset` of plain dict rows, renames
columns, checks that a `prompt` column exists (a `ConfigError` naming the source, the columns found and the
fix), and applies the prompt options (system prompt, instruction suffix, conversational format).

Which source a string means, tried in order: `reasoning_gym:<task>`; an existing path (file by extension,
or a folder saved by `datasets`' `save_to_disk` or holding data files); `pkg.mod:fn` (a callable);
otherwise a `datasets.load_dataset` name.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cohort.data.dataset import PromptDataset, is_conversational
from cohort.errors import ConfigError
from cohort.resolve import resolve_object

REASONING_GYM_PREFIX = "reasoning_gym:"
_PROMPT_LIKE = ("question", "problem", "query", "instruction", "input", "text", "messages")
_SURROGATE = re.compile("[\ud800-\udfff]")  # half of a UTF-16 pair: no tokenizer or UTF-8 file can take it


def load_prompt_dataset(
    source: Any,
    *,
    split: str = "train",
    prompt_column: str = "prompt",
    columns: Mapping[str, str] | None = None,
    system_prompt: str | None = None,
    few_shot: Sequence[Mapping[str, Any]] | None = None,
    instruction: str | None = None,
    conversational: bool = False,
    limit: int | None = None,
    seed: int = 0,
    **source_kwargs: Any,
) -> PromptDataset:
    """Load prompts from `source` into a `PromptDataset`.

    source: a path (.jsonl/.json/.parquet/.csv, or a folder), a `datasets` name, `"reasoning_gym:<task>"`
        (settings such as size, min_terms, ... go in `source_kwargs`; `seed` seeds the generator), an
        import path `"pkg.mod:fn"` or a callable (called with `source_kwargs`, returning rows, a dict of
        columns, a `datasets.Dataset` or a `PromptDataset`), or a list of row dicts.
    split: the `datasets` split (ignored for single files, callables and reasoning-gym).
    prompt_column / columns: renames, e.g. `prompt_column="question"` or `columns={"question": "prompt"}`.
    system_prompt: a system message (conversational rows) or a text prefix plus a blank line (text rows).
    few_shot: example messages placed after the system message and before each conversational prompt's own
        messages (worked examples; assistant turns may carry `tool_calls`, tool results are `tool` messages).
    instruction: appended after a blank line to the text prompt or to the last user message.
    conversational: turn text prompts into one user message, so the tokenizer's chat template applies.
    limit: keep only the first `limit` rows.
    """
    name = source if isinstance(source, str) else getattr(source, "__name__", type(source).__name__)
    rows = _load_rows(source, split=split, seed=seed, **source_kwargs)
    rename = dict(columns or {})
    if prompt_column != "prompt":
        rename.setdefault(prompt_column, "prompt")
    if rename:
        rows = [{rename.get(k, k): v for k, v in row.items()} for row in rows]
    _check_prompt_column(rows, str(name))
    if limit is not None:
        rows = rows[:limit]
    rows = [
        _format_row(row, system_prompt=system_prompt, few_shot=few_shot, instruction=instruction,
                    conversational=conversational)
        for row in rows
    ]
    check_text(rows, f"data.source={str(name)!r}")
    return PromptDataset(rows, source=str(name))


def _load_rows(source: Any, *, split: str, seed: int, **kwargs: Any) -> list[dict[str, Any]]:
    if isinstance(source, PromptDataset):
        return [dict(r) for r in source.rows]
    if isinstance(source, list):
        return [dict(r) for r in source]
    if callable(source) and not isinstance(source, str):
        return _rows_from_object(source(**kwargs), getattr(source, "__name__", repr(source)))
    if isinstance(source, Mapping) and source and all(hasattr(v, "to_list") for v in source.values()):
        return list(_pick_split(source, split, type(source).__name__).to_list())  # a DatasetDict
    if not isinstance(source, str):
        return _rows_from_object(source, type(source).__name__)
    if source.startswith(REASONING_GYM_PREFIX):
        return reasoning_gym_rows(source[len(REASONING_GYM_PREFIX) :], seed=seed, **kwargs)
    if os.path.exists(source):
        return _rows_from_path(Path(source), split=split, **kwargs)
    if ":" in source and not source.startswith(("hf:", "http")):
        return _rows_from_object(import_object(source)(**kwargs), source)
    return _rows_from_hub(source, split=split, **kwargs)


def import_object(path: str) -> Any:
    """Resolve `"pkg.mod:attr"` (attr may be dotted): `cohort.resolve.resolve_object`, the one resolver."""
    return resolve_object(path, field="import path", expects="function")


def _rows_from_object(obj: Any, name: str) -> list[dict[str, Any]]:
    """Rows from what a callable returned: rows, a dict of columns, a datasets.Dataset, a PromptDataset."""
    if isinstance(obj, PromptDataset):
        return [dict(r) for r in obj.rows]
    if isinstance(obj, Mapping):
        cols = {k: list(v) for k, v in obj.items()}
        n = len(next(iter(cols.values()), []))
        return [{k: v[i] for k, v in cols.items()} for i in range(n)]
    if hasattr(obj, "to_list"):  # datasets.Dataset
        return list(obj.to_list())
    if hasattr(obj, "__iter__") and not isinstance(obj, str | bytes):
        rows = list(obj)
        if all(isinstance(r, Mapping) for r in rows):
            return [dict(r) for r in rows]
    raise ConfigError(
        f"Source {name!r} gave a {type(obj).__name__}; expected a list of row dicts, a dict of columns, "
        "a datasets.Dataset or a PromptDataset."
    )


def _rows_from_path(path: Path, *, split: str, **kwargs: Any) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if path.is_dir():
        return _rows_from_folder(path, split=split, **kwargs)
    if suffix == ".jsonl":
        rows = []
        for number, line in enumerate(_read_text(path).split("\n"), 1):
            if line.strip():
                rows.append(_json_value(line, path, f" line {number}"))
                _check_text(rows[-1], f"data.source={str(path)!r}: line {number}")
        if not all(isinstance(r, Mapping) for r in rows):
            bad = next(i for i, r in enumerate(rows) if not isinstance(r, Mapping))
            raise ConfigError(f"data.source={str(path)!r}: row {bad + 1} is a {type(rows[bad]).__name__}, not a "
                              "JSON object; write one {\"prompt\": ...} object per line.")
        return rows
    if suffix == ".json":
        data = _json_value(_read_text(path), path, "")
        if isinstance(data, Mapping) and isinstance(data.get("data"), list):
            data = data["data"]  # the {"data": [...]} layout many exports use
        return _rows_from_object(data, str(path))
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # optional dependency (the data extra: parquet files)

        return pq.read_table(path).to_pylist()
    if suffix == ".csv":
        # csv keeps every value a string: numbers stay exactly as written (gold answers are compared as text).
        return [dict(r) for r in csv.DictReader(io.StringIO(_read_text(path), newline=""))]
    raise ConfigError(f"Cannot read {str(path)!r}: unknown extension {suffix!r}; use .jsonl, .json, .parquet or .csv.")


def _read_text(path: Path) -> str:
    """The file's text as UTF-8; bytes that are not UTF-8 are a ConfigError naming the line and column."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")  # a byte-order mark, as some editors write, is not part of the text
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ConfigError(f"data.source={str(path)!r}: line {line}, column {column} is not UTF-8 (byte "
                          f"0x{data[exc.start]:02x}); save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                          ) from None


def _surrogate_at(value: Any, column: str) -> tuple[str, int] | None:
    """(the column, e.g. prompt[0].content, and the character index) of the first lone surrogate in a value."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        return (column, found.start()) if found else None
    items: Any = ()
    if isinstance(value, Mapping):
        items = ((f"{column}.{k}" if column else str(k), v) for k, v in value.items())
    elif isinstance(value, list | tuple):
        items = ((f"{column}[{i}]", v) for i, v in enumerate(value))
    for where, item in items:
        hit = _surrogate_at(item, where)
        if hit is not None:
            return hit
    return None


def check_text(rows: Sequence[Any], source: str) -> None:
    """Every row's text must be encodable: a lone surrogate (an escaped \\ud800 in JSON) breaks the tokenizer
    and every file it is written to. A ConfigError names `source`, the row (from 1) and the column."""
    for i, row in enumerate(rows):
        _check_text(row, f"{source}: row {i + 1}")


def _check_text(row: Any, where: str) -> None:
    hit = _surrogate_at(row, "")
    if hit is not None:
        column, at = hit
        raise ConfigError(f"{where}, column {column!r}, character {at + 1} is a lone surrogate (half of a UTF-16 "
                          "pair, e.g. an escaped \\ud800 in JSON), which is not text; remove it or write the whole "
                          "pair")


def _json_value(text: str, path: Path, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"data.source={str(path)!r}{where} is not valid JSON ({exc.msg} at column {exc.colno}); "
                          "fix that line (a .jsonl file holds one JSON object per line).") from None


def _rows_from_folder(path: Path, *, split: str, **kwargs: Any) -> list[dict[str, Any]]:
    import datasets  # optional dependency (the data extra: Hugging Face datasets)

    if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = _pick_split(ds, split, str(path))
        return list(ds.to_list())
    return _rows_from_hub(str(path), split=split, **kwargs)


def _pick_split(ds: Any, split: str, name: str) -> Any:
    if split not in ds:
        raise ConfigError(f"Dataset {name!r} has no split {split!r}; it has {sorted(ds)}. Set split= to one of them.")
    return ds[split]


def _rows_from_hub(name: str, *, split: str, **kwargs: Any) -> list[dict[str, Any]]:
    try:
        import datasets  # optional dependency (the data extra: Hugging Face datasets)
    except ImportError as e:
        raise ConfigError(
            f"Loading {name!r} needs the `datasets` package: pip install 'cohort-rl[data]'."
        ) from e
    try:
        ds = datasets.load_dataset(name, split=split, **kwargs)
    except Exception as e:  # datasets raises many types (FileNotFound, ConnectionError, DatasetNotFound, ...)
        raise ConfigError(
            f"Could not load dataset {name!r} (split {split!r}): {type(e).__name__}: {e}. Give a local file "
            "(.jsonl/.json/.parquet/.csv), a folder, 'reasoning_gym:<task>', 'pkg.module:function', or a "
            "datasets name that is cached locally (this machine may be offline)."
        ) from e
    return list(ds.to_list())


def reasoning_gym_rows(task: str, *, seed: int = 0, size: int = 500, **config: Any) -> list[dict[str, Any]]:
    """Generate `size` problems of a reasoning-gym task: rows with prompt, answer and metadata.

    `metadata` (with `source_dataset`) is what `cohort.rewards.reasoning_gym` needs to score an answer.
    """
    try:
        import reasoning_gym  # optional dependency (the data extra: reasoning-gym tasks)
    except ImportError as e:
        raise ConfigError("reasoning-gym sources need `pip install reasoning-gym` (cohort-rl[data]).") from e
    try:
        ds = reasoning_gym.create_dataset(task, seed=seed, size=size, **config)
    except Exception as e:  # unknown task name or bad settings: reasoning-gym raises several types
        raise ConfigError(
            f"reasoning-gym could not create task {task!r} with settings {config} (seed={seed}, size={size}): "
            f"{type(e).__name__}: {e}. Check the task name and its config fields."
        ) from e
    return [{"prompt": e["question"], "answer": e["answer"], "metadata": e["metadata"]} for e in ds]


def _check_prompt_column(rows: list[dict[str, Any]], name: str) -> None:
    if not rows:
        raise ConfigError(f"Dataset {name!r} (data.source) is empty (0 rows); check the path, data.split or the "
                          "size option.")
    found = list(rows[0])
    if "prompt" in found:
        return
    hint = next((c for c in found if c.lower() in _PROMPT_LIKE), None)
    fix = (f"set data.prompt_column={hint} (prompt_column={hint!r} from Python)" if hint
           else "set data.prompt_column=<your column> (prompt_column= from Python)")
    raise ConfigError(
        f"Dataset {name!r} has no 'prompt' column (columns found: {found}). A prompt column is required: "
        f"{fix}, or columns={{'<old>': 'prompt'}} to rename it."
    )


def _format_row(
    row: dict[str, Any], *, system_prompt: str | None, instruction: str | None, conversational: bool,
    few_shot: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    prompt = row["prompt"]
    if isinstance(prompt, str):
        if instruction:
            prompt = f"{prompt}\n\n{instruction}"
        if conversational:
            prompt = [{"role": "user", "content": prompt}]
            if system_prompt:
                prompt.insert(0, {"role": "system", "content": system_prompt})
        elif system_prompt:
            prompt = f"{system_prompt}\n\n{prompt}"
    elif is_conversational(prompt):
        prompt = [dict(m) for m in prompt]
        if instruction:
            users = [i for i, m in enumerate(prompt) if m["role"] == "user"]
            last_user = users[-1] if users else len(prompt) - 1
            prompt[last_user]["content"] = f"{prompt[last_user]['content']}\n\n{instruction}"
        if system_prompt and prompt[0]["role"] != "system":
            prompt.insert(0, {"role": "system", "content": system_prompt})
    if few_shot:
        if not is_conversational(prompt):
            raise ConfigError(
                "data.few_shot needs conversational prompts (chat messages), but a prompt is plain text; set "
                "data.options.conversational=true (text prompts become one user message) or drop data.few_shot"
            )
        at = 1 if prompt and prompt[0]["role"] == "system" else 0
        prompt[at:at] = [dict(m) for m in few_shot]
    return {**row, "prompt": prompt}

