"""HF safetensors folders: a reader of the slices a rank holds, a writer of indexed shards."""

import json

import torch
from safetensors.torch import save_file

from slime_mt.safetensors_files import CheckpointReader, ShardWriter, load_hf_state


def test_reader_reads_only_the_requested_slices(tmp_path):
    full = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    save_file({"w": full, "v": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    reader = CheckpointReader(tmp_path)
    assert torch.equal(reader.rows("w", 2, 4), full[2:4])
    assert torch.equal(reader.cols("w", 3, 7), full[:, 3:7])
    assert reader.shape("w") == [6, 8] and reader.names() == {"w", "v"}
    memory = CheckpointReader(tensors={"w": full})
    assert torch.equal(memory.cols("w", 1, 2), full[:, 1:2])


def test_shard_writer_splits_and_indexes(tmp_path):
    tensors = {f"t{i}": torch.full((256,), float(i)) for i in range(5)}  # 1 KiB each
    writer = ShardWriter(tmp_path, "model", max_bytes=2048)
    for name, t in tensors.items():
        writer.add(name, t)
    files = writer.close()
    assert [f.name for f in files] == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    back = load_hf_state(tmp_path)
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    single = ShardWriter(tmp_path / "one", "model")
    single.add("a", torch.ones(2))
    assert [f.name for f in single.close()] == ["model.safetensors"]
