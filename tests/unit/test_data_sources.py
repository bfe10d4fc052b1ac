"""load_prompt_dataset: every source kind, column renames, prompt options, and the missing-prompt error."""

from __future__ import annotations

import csv
import json

import pytest

from cohort.data import PromptDataset, load_prompt_dataset
from cohort.errors import ConfigError

ROWS = [
    {"prompt": "What is 2 + 3?", "answer": "5", "level": 1},
    {"prompt": "What is 10 - 4?", "answer": "6", "level": 2},
    {"prompt": "What is 3 * 3?", "answer": "9", "level": 2},
]


def make_rows(n: int = 3, offset: int = 0):
    """A callable source, imported by path in the tests below."""
    return [{"prompt": f"What is {i} + {offset}?", "answer": str(i + offset)} for i in range(n)]


def _write(tmp_path, kind: str, rows=ROWS):
    path = tmp_path / f"data.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    elif kind == "json":
        path.write_text(json.dumps(rows))
    elif kind == "csv":
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet"])
def test_local_files(tmp_path, kind):
    ds = load_prompt_dataset(str(_write(tmp_path, kind)))
    assert isinstance(ds, PromptDataset) and len(ds) == 3
    assert [r["prompt"] for r in ds] == [r["prompt"] for r in ROWS]
    assert ds.reward_columns == ["answer", "level"]
    # csv keeps text; the typed formats keep numbers
    assert ds[1]["level"] == ("2" if kind == "csv" else 2)
    assert ds[2]["answer"] == "9"


def test_json_with_data_key(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"data": ROWS, "version": 1}))
    assert len(load_prompt_dataset(str(path))) == 3


def test_datasets_folder_and_object(tmp_path):
    datasets = pytest.importorskip("datasets", reason="needs datasets: pip install datasets")
    ds = datasets.Dataset.from_list(ROWS)
    assert load_prompt_dataset(ds)[0]["answer"] == "5"
    ds.save_to_disk(str(tmp_path / "saved"))
    loaded = load_prompt_dataset(str(tmp_path / "saved"))
    assert [r["prompt"] for r in loaded] == [r["prompt"] for r in ROWS]
    splits = datasets.DatasetDict({"train": ds, "test": ds.select([0])})
    assert len(load_prompt_dataset(splits)) == 3 and len(load_prompt_dataset(splits, split="test")) == 1
    splits.save_to_disk(str(tmp_path / "dd"))
    assert len(load_prompt_dataset(str(tmp_path / "dd"), split="test")) == 1
    with pytest.raises(ConfigError, match=r"has no split 'validation'; it has \['test', 'train'\]"):
        load_prompt_dataset(str(tmp_path / "dd"), split="validation")


def test_datasets_builder_on_local_files(tmp_path):
    pytest.importorskip("datasets", reason="needs datasets: pip install datasets")
    path = _write(tmp_path, "jsonl")
    ds = load_prompt_dataset("json", data_files=str(path))
    assert len(ds) == 3 and ds[0]["answer"] == "5"


def test_unknown_hub_name_is_config_error(monkeypatch):
    datasets = pytest.importorskip("datasets", reason="needs datasets: pip install datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # no network retries: fail at once
    with pytest.raises(ConfigError, match=r"Could not load dataset 'surely/not-a-dataset-xyz'.*reasoning_gym"):
        load_prompt_dataset("surely/not-a-dataset-xyz")


def test_callable_object_and_import_path():
    ds = load_prompt_dataset(make_rows, n=4, offset=10)
    assert len(ds) == 4 and ds[3] == {"prompt": "What is 3 + 10?", "answer": "13"}
    ds = load_prompt_dataset("tests.unit.test_data_sources:make_rows", n=2)
    assert [r["answer"] for r in ds] == ["0", "1"]
    cols = load_prompt_dataset(lambda: {"prompt": ["a", "b"], "answer": ["1", "2"]})
    assert cols[1] == {"prompt": "b", "answer": "2"}
    with pytest.raises(ConfigError, match=r"gave a int; expected a list of row dicts"):
        load_prompt_dataset(lambda: 3)


def test_reasoning_gym_source():
    pytest.importorskip("reasoning_gym", reason="needs reasoning-gym: pip install reasoning-gym==0.1.25")
    ds = load_prompt_dataset("reasoning_gym:chain_sum", size=6, seed=5, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    assert len(ds) == 6 and ds.reward_columns == ["answer", "metadata"]
    for row in ds:
        meta = row["metadata"]
        assert meta["source_dataset"] == "chain_sum" and meta["num_terms"] == 2
        assert int(row["answer"]) == eval(meta["expression"])
        assert meta["expression"] in row["prompt"]
    again = load_prompt_dataset("reasoning_gym:chain_sum", size=6, seed=5, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    assert [r["prompt"] for r in again] == [r["prompt"] for r in ds]  # seeded: reproducible
    with pytest.raises(ConfigError, match=r"could not create task 'no_such_task'"):
        load_prompt_dataset("reasoning_gym:no_such_task", size=2)


def test_missing_prompt_column_names_source_columns_and_fix(tmp_path):
    path = _write(tmp_path, "jsonl", [{"question": "2+2?", "answer": "4"}])
    with pytest.raises(ConfigError) as e:
        load_prompt_dataset(str(path))
    msg = str(e.value)
    assert str(path) in msg and "['question', 'answer']" in msg and "prompt_column='question'" in msg
    ds = load_prompt_dataset(str(path), prompt_column="question")
    assert ds[0] == {"prompt": "2+2?", "answer": "4"}
    ds = load_prompt_dataset(str(path), columns={"question": "prompt", "answer": "solution"})
    assert ds[0] == {"prompt": "2+2?", "solution": "4"}


def test_unknown_extension_and_bad_import_path(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("x")
    with pytest.raises(ConfigError, match=r"unknown extension '\.txt'"):
        load_prompt_dataset(str(path))
    with pytest.raises(ConfigError, match=r"Module 'tests.unit.test_data_sources' has no attribute 'nope'"):
        load_prompt_dataset("tests.unit.test_data_sources:nope")


def test_prompt_options_standard_rows():
    ds = load_prompt_dataset(ROWS, system_prompt="Be brief.", instruction="Answer with a number.")
    assert ds[0]["prompt"] == "Be brief.\n\nWhat is 2 + 3?\n\nAnswer with a number."
    assert not ds.is_conversational


def test_prompt_options_conversational():
    ds = load_prompt_dataset(ROWS, system_prompt="Be brief.", instruction="Answer with a number.", conversational=True)
    assert ds.is_conversational
    assert ds[0]["prompt"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?\n\nAnswer with a number."},
    ]
    chat = [{"prompt": [{"role": "system", "content": "Own."}, {"role": "user", "content": "Hi"}], "answer": "x"}]
    out = load_prompt_dataset(chat, system_prompt="Ignored: the row has one.", instruction="Reply.")
    assert out[0]["prompt"] == [{"role": "system", "content": "Own."}, {"role": "user", "content": "Hi\n\nReply."}]
    assert chat[0]["prompt"][1]["content"] == "Hi"  # the source rows are not modified


def test_limit_and_empty():
    assert len(load_prompt_dataset(ROWS, limit=2)) == 2
    with pytest.raises(ConfigError, match="is empty"):
        load_prompt_dataset([])


FEW_SHOT = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "", "tool_calls": [{"name": "calculator", "arguments": {"expression": "2 + 3"}}]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "5"},
]


def test_few_shot_goes_after_the_system_prompt_and_before_the_question():
    ds = load_prompt_dataset([{"prompt": "What is 7 + 8?"}], system_prompt="Use the tool.", few_shot=FEW_SHOT,
                             conversational=True, instruction="Answer with a number.")
    prompt = ds.rows[0]["prompt"]
    assert [m["role"] for m in prompt] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert prompt[1:5] == FEW_SHOT and prompt[1] is not FEW_SHOT[0]  # copies: rows never share dicts
    # the instruction goes to the prompt's own question, not to an example
    assert prompt[-1]["content"] == "What is 7 + 8?\n\nAnswer with a number."
    chat = [{"role": "user", "content": "Hi"}]
    assert [m["role"] for m in load_prompt_dataset([{"prompt": chat}], few_shot=FEW_SHOT).rows[0]["prompt"]] == [
        "user", "assistant", "tool", "assistant", "user"]


def test_few_shot_on_text_prompts_names_the_fix():
    with pytest.raises(ConfigError, match=r"data\.few_shot needs conversational prompts.*conversational=true"):
        load_prompt_dataset([{"prompt": "What is 7 + 8?"}], few_shot=FEW_SHOT)


def test_few_shot_config_is_validated():
    from cohort.config import CohortConfig
    from cohort.config.checks import validate_fields as validate

    cfg = CohortConfig()
    cfg.data.few_shot = [{"role": "robot", "content": "hi"}]
    with pytest.raises(ConfigError, match=r"data\.few_shot"):
        validate(cfg)
