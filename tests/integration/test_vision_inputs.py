"""Image columns and their bad inputs (issue 17): each failure is a DataError (a ConfigError: the CLI exits 2)
naming the dataset, the row and the fix, raised while the data is encoded, before any training."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from tests.helpers.tiny_vlms import build, solid
from tests.helpers.toy_task import tiny_model

from cohort.data import load_prompt_dataset
from cohort.errors import ConfigError, DataError
from cohort.vision.inputs import VisionPrompt, encode_vision_dataset, load_image, place_image_parts
from cohort.vision.setup import encode_dataset

QUESTION = [{"role": "user", "content": "what colour is this ?"}]


@pytest.fixture(scope="module")
def qwen():
    return build("qwen2_vl")


def test_image_paths_pil_images_and_lists_encode(tmp_path, qwen):
    _model, processor = qwen
    path = tmp_path / "red.png"
    solid("red").save(path)
    rows = [{"prompt": QUESTION, "image": str(path)}, {"prompt": QUESTION, "image": solid("blue")},
            {"prompt": QUESTION, "images": [solid("green"), str(path)]}, {"prompt": QUESTION}]
    data = encode_vision_dataset(load_prompt_dataset(rows), processor, 512)
    image = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert [ids.count(image) for ids in data.prompt_ids] == [4, 4, 8, 0]
    assert all(isinstance(ids, VisionPrompt) for ids in data.prompt_ids)
    assert data.prompt_ids[2].vision_inputs()["image_grid_thw"].shape == (2, 3)
    assert data.prompt_ids[3].vision_inputs() == {}
    # the rows keep their columns for reward functions (TRL passes every column)
    assert data.rows[0]["image"] == str(path)


def test_images_go_to_the_first_user_message_and_spelled_out_parts_must_match():
    placed = place_image_parts([{"role": "system", "content": "be brief"}, *QUESTION], 2, "d", 0, "<image>")
    assert placed[1]["content"][:2] == [{"type": "image"}, {"type": "image"}]
    assert placed[0]["content"] == [{"type": "text", "text": "be brief"}]
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what ?"}]}]
    with pytest.raises(DataError, match=r"row 7: the messages hold 1 \{'type': 'image'\} part\(s\) for 2 image"):
        place_image_parts(parts, 2, "d", 7, "<image>")


def test_a_text_prompt_without_the_placeholder_names_the_row_and_the_fix(qwen):
    _, processor = qwen
    rows = [{"prompt": "what colour is this ?", "image": solid("red")}]
    with pytest.raises(DataError) as err:
        encode_vision_dataset(load_prompt_dataset(rows), processor, 512)
    msg = str(err.value)
    assert "row 0" in msg and "<|image_pad|>" in msg and "conversational" in msg


def test_an_unreadable_image_file_names_the_row_and_the_fix(tmp_path, qwen):
    _, processor = qwen
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not a png")
    rows = [{"prompt": QUESTION, "image": solid("red")}, {"prompt": QUESTION, "image": str(bad)}]
    with pytest.raises(DataError, match=r"row 1, column 'image': cannot read image .*broken.png.*remove the row"):
        encode_vision_dataset(load_prompt_dataset(rows), processor, 512)
    with pytest.raises(DataError, match=r"row 0, column 'images': image file .*missing.png' does not exist"):
        load_image(str(tmp_path / "missing.png"), "d", 0, "images")


def test_an_image_column_on_a_text_model_is_an_error():
    tok = make_tiny_tokenizer()
    rows = [{"prompt": "hello"}, {"prompt": "look", "image": solid("red")}]
    with pytest.raises(DataError, match=r"row 1 has an 'image' column, but model 'tiny' is a text-only model"):
        encode_dataset(load_prompt_dataset(rows), tok, None, tiny_model(tok), 64, "left", model_name="tiny")


def test_a_vlm_given_a_tokenizer_instead_of_its_processor_is_an_error(qwen):
    model, processor = qwen
    rows = [{"prompt": QUESTION, "image": solid("red")}]
    with pytest.raises(DataError, match="processing_class=AutoProcessor"):
        encode_dataset(load_prompt_dataset(rows), processor.tokenizer, None, model, 64, "left")


def test_prompts_with_images_are_dropped_not_truncated(qwen):
    _, processor = qwen
    rows = [{"prompt": QUESTION, "image": solid("red")},
            {"prompt": [{"role": "user", "content": "what colour is this ? " * 10}], "image": solid("red")}]
    data = encode_vision_dataset(load_prompt_dataset(rows), processor, 20, truncation="left")
    assert len(data) == 1 and data.stats.num_dropped == 1
    with pytest.raises(DataError, match="cannot be truncated"):
        data.prompt_ids[0][-5:]
    assert isinstance(DataError("x"), ConfigError)


def test_the_cli_exits_2_with_the_row_for_an_image_column_on_a_text_model(tmp_path):
    from tests.helpers.toy_task import write_toy_workspace

    model_dir, _ = write_toy_workspace(tmp_path)
    data = tmp_path / "images.jsonl"
    data.write_text(json.dumps({"prompt": "what colour?", "image": str(tmp_path / "x.png")}) + "\n")
    out = subprocess.run([sys.executable, "-m", "cohort.cli", "train", f"model.name_or_path={model_dir}",
                          f"data.source={data}", f"run.output_dir={tmp_path / 'run'}", "train.prompts_per_step=1",
                          "generation.max_completion_length=16"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "row 0 has an 'image' column" in out.stderr + out.stdout
    assert not (tmp_path / "run").exists()


def test_eval_overlap_compares_images_too():
    from cohort.data import drop_overlap

    train = load_prompt_dataset([{"prompt": QUESTION, "image": solid(c)} for c in ("red", "green", "blue")])
    held_out = load_prompt_dataset([{"prompt": QUESTION, "image": solid("green")}])
    kept, dropped = drop_overlap(train, held_out)
    assert dropped == 1 and [r["image"].getpixel((0, 0)) for r in kept.rows] == [(220, 20, 20), (20, 20, 220)]
