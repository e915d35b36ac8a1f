"""Prompt datasets: jsonl and parquet rows, <image> pairing, errors naming row and file, cursor."""

import base64
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from slime_mt.config import DataConfig
from slime_mt.data import PromptDataset, load_rows
from slime_mt.errors import DatasetError


def png_bytes(color=(255, 0, 0), size=(20, 10)):
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


CFG = DataConfig(input_key="problem", label_key="answer", multimodal_keys={"image": "images"})


def test_jsonl_rows_with_images_from_path_base64_and_data_uri(tmp_path):
    (tmp_path / "a.png").write_bytes(png_bytes((1, 2, 3)))
    b64 = base64.b64encode(png_bytes((4, 5, 6))).decode()
    rows = load_rows(
        write_jsonl(
            tmp_path / "train.jsonl",
            [
                {"problem": "<image>Find x.", "answer": "4", "images": ["a.png"], "metadata": {"level": 2}},
                {
                    "problem": "Compare <image> and <image>",
                    "answer": "1/2",
                    "images": [b64, "data:image/png;base64," + b64],
                },
                {"problem": "No image here", "answer": 3},
            ],
        ),
        CFG,
    )
    assert rows[0].prompt == [{"type": "image", "image": rows[0].images[0]}, {"type": "text", "text": "Find x."}]
    assert rows[0].images[0].getpixel((0, 0)) == (1, 2, 3)
    assert rows[0].metadata == {"level": 2} and rows[0].label == "4"
    assert [p["type"] for p in rows[1].prompt] == ["text", "image", "text", "image"]
    assert rows[1].images[1].getpixel((0, 0)) == (4, 5, 6)
    assert rows[2].prompt == "No image here" and rows[2].images == []


def test_parquet_rows_with_image_structs(tmp_path):
    table = pa.table(
        {
            "problem": ["<image>How long is AB?"],
            "answer": ["5"],
            "images": [[{"bytes": png_bytes((9, 9, 9)), "path": None}]],
        }
    )
    pq.write_table(table, tmp_path / "train.parquet")
    [row] = load_rows(tmp_path / "train.parquet", CFG)
    assert row.images[0].getpixel((0, 0)) == (9, 9, 9)
    assert row.prompt[1] == {"type": "text", "text": "How long is AB?"}


def test_chat_message_prompts_get_image_parts(tmp_path):
    (tmp_path / "a.png").write_bytes(png_bytes())
    [row] = load_rows(
        write_jsonl(
            tmp_path / "t.jsonl",
            [
                {
                    "problem": [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "<image>x?"}],
                    "images": ["a.png"],
                    "answer": "x",
                }
            ],
        ),
        CFG,
    )
    assert row.prompt[0] == {"role": "system", "content": "Be exact."}
    assert row.prompt[1]["content"][0]["type"] == "image"


@pytest.mark.parametrize(
    "rows,message",
    [
        (
            [{"problem": "<image><image>", "answer": 1, "images": ["a.png"]}],
            r"row 1 of bad.jsonl: 2 <image> placeholders but 1 images",
        ),
        (
            [{"problem": "ok", "answer": 1}, {"problem": "none", "answer": 1, "images": ["a.png"]}],
            r"row 2 of bad.jsonl: 0 <image> placeholders but 1",
        ),
        (
            [{"problem": "<image>", "answer": 1, "images": ["missing.png"]}],
            r"row 1 of bad.jsonl, image 0: cannot read image",
        ),
        (
            [{"problem": "<image>", "answer": 1, "images": ["data:image/png;base64,AAAA"]}],
            r"row 1 of bad.jsonl, image 0: cannot read",
        ),
        (
            [{"question": "x", "answer": 1}],
            r"row 1 of bad.jsonl: no key 'problem' \(--input-key\); the row's keys: \['answer', 'question'\]",
        ),
        ([{"problem": "x", "answer": 1}, {"problem": "y"}], r"row 2 of bad.jsonl: no key 'answer' \(--label-key\)"),
        (
            [{"problem": "<image>", "answer": 1, "pictures": ["a.png"]}],
            r"row 1 of bad.jsonl: 1 <image> placeholders but no key 'images' \(--multimodal-keys\); the row's "
            r"keys: \['answer', 'pictures', 'problem'\]",
        ),
        (
            [{"problem": 5, "answer": 1}],
            r"row 1 of bad.jsonl: prompt 'problem' must be a string or a list of chat messages",
        ),
        (
            [{"problem": "x", "answer": 1, "metadata": "not json"}],
            r"row 1 of bad.jsonl: metadata 'metadata' is a string but not JSON",
        ),
    ],
)
def test_bad_rows_name_row_and_file(tmp_path, rows, message):
    (tmp_path / "a.png").write_bytes(png_bytes())
    with pytest.raises(DatasetError, match=message):
        load_rows(write_jsonl(tmp_path / "bad.jsonl", rows), CFG)


def test_a_tool_key_must_be_there_and_a_missing_label_warns_unless_the_key_is_given(tmp_path, caplog):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "a", "tools": [], "label": 1}, {"prompt": "b"}])
    with pytest.raises(DatasetError, match=r"row 2 of rows.jsonl: no key 'tools' \(--tool-key\)"):
        load_rows(path, DataConfig(tool_key="tools"))
    rows = load_rows(path, DataConfig())
    assert [r.label for r in rows] == [1, None]
    assert "1 of 2 rows have no 'label' key: their samples get label None" in caplog.text
    with pytest.raises(DatasetError, match=r"row 2 of rows.jsonl: no key 'label' \(--label-key\)"):
        load_rows(path, DataConfig(label_key="label"))  # given, even as the default's name: required


def test_rows_are_numbered_from_one_as_lines_and_parquet_positions(tmp_path):
    """Every data error counts rows the same way: a .jsonl row by its line (blank lines counted), a
    .parquet row by its position, both from 1."""
    (tmp_path / "gaps.jsonl").write_text('{"problem": "a", "answer": 1}\n\n{"problem": "b"}\n')
    with pytest.raises(DatasetError, match=r"row 3 of gaps.jsonl: no key 'answer' \(--label-key\)"):
        load_rows(tmp_path / "gaps.jsonl", CFG)
    rows = [{"problem": "a", "answer": 1, "metadata": "{}"}, {"problem": "b", "answer": 2, "metadata": "oops"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    with pytest.raises(DatasetError, match=r"row 2 of t.parquet: metadata 'metadata' is a string but not JSON"):
        load_rows(tmp_path / "t.parquet", CFG)


def test_bad_json_line_and_missing_file(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"problem": "a"}\n{oops\n')
    with pytest.raises(DatasetError, match=r"row 2 of bad.jsonl: not valid JSON"):
        load_rows(tmp_path / "bad.jsonl", CFG)
    with pytest.raises(DatasetError, match="prompt data file not found"):
        load_rows(tmp_path / "nope.jsonl", CFG)


def test_groups_share_group_index_and_cursor_round_trips(tmp_path):
    rows = load_rows(write_jsonl(tmp_path / "t.jsonl", [{"problem": f"q{i}", "answer": i} for i in range(5)]), CFG)
    data = PromptDataset(rows, n_samples_per_prompt=3, shuffle=True, seed=1)
    first = data.get_samples(2)
    assert [[s.group_index for s in g] for g in first] == [[0, 0, 0], [1, 1, 1]]
    assert [s.index for g in first for s in g] == list(range(6))
    state = data.state_dict()
    following = [g[0].prompt for g in data.get_samples(6)]  # crosses an epoch boundary
    resumed = PromptDataset(rows, n_samples_per_prompt=3, shuffle=True, seed=1)
    resumed.load_state_dict(state)
    assert [g[0].prompt for g in resumed.get_samples(6)] == following
    epoch0 = [g[0].prompt for g in PromptDataset(rows, 1, shuffle=True, seed=1).get_samples(5)]
    assert sorted(epoch0) == [f"q{i}" for i in range(5)] and epoch0 != [f"q{i}" for i in range(5)]
