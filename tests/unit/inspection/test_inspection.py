"""Inspecting a run: rollout dumps (saved, loaded with and without slime_mt, replayed), rollout-only
runs, turn records, the trace, and ``slime-mt inspect`` (its text summary, and its HTML page driven
in the operating system's Chromium through Playwright).

Two real runs are shared by the module: a rollout-only run of the tiny Qwen2.5-VL on geo3k (step-wise,
the ``window:1`` context policy, an environment whose first step of every episode fails once), and a
two-step run of the demo recipe that a train-only run replays."""

import json

import pytest
import torch

from slime_mt.config.checkpoint import parse_turn_records
from slime_mt.errors import TurnRecordsError
from slime_mt.inspection.dumps import load_dump, save_dump, train_batch_of
from slime_mt.inspection.report import text_summary, token_classes, trained_flags, write_report
from slime_mt.inspection.turn_records import chosen_groups
from slime_mt.rollout.finalize import finalize
from slime_mt.timeline import TraceWriter, load_trace
from slime_mt.types import Sample, Status


def two_turn_sample(index: int, group: int, status: Status = Status.COMPLETED) -> Sample:
    s = Sample(index=index, group_index=group, prompt="p")
    s.set_prompt_tokens([1, 2, 3])
    s.append_turn([10, 11], [-0.1, -0.2], weight_version="0")
    s.append_observation([20, 21, 22])
    s.append_turn([12], [-0.3], weight_version="0")
    s.status, s.reward = status, float(index % 2)
    return s


@pytest.mark.parametrize("sample_format,merge", [("concat", False), ("step_wise", False), ("step_wise", True)])
def test_token_classes_follow_what_each_format_trained(tmp_path, sample_format, merge):
    """Generated tokens are 'trained output' exactly where a training sequence has loss mask 1;
    a FAILED sample's are 'masked'; observations and the prompt keep their class."""
    from slime_mt.types import TrainBatch

    groups = [[two_turn_sample(0, 0), two_turn_sample(1, 0, Status.FAILED)]]
    sequences, _ = finalize(groups[0], sample_format, merge)
    batch = TrainBatch(sequences, [0.5] * len(sequences), {}, {}, 0.0, 0.0, {}, [0], "")
    data = load_dump(save_dump(tmp_path / "rollout_0.pt", 0, groups, batch, {}))
    by_id = {}
    for seq in data["train"]["samples"]:
        by_id.setdefault(seq["trajectory_id"], []).append(seq)
    classes = [token_classes(s, trained_flags(s, by_id.get(f"0/{s['index']}", []))) for s in data["samples"]]
    assert classes == ["ppp" + "oo" + "bbb" + "o", "ppp" + "xx" + "bbb" + "x"]
    if merge:
        assert [seq["turns"] for seq in data["train"]["samples"]] == [[0, 1], [0, 1]]


def test_turn_record_sampling_takes_whole_groups():
    groups = [[two_turn_sample(2 * g + k, g) for k in range(2)] for g in range(5)]
    chosen = chosen_groups(groups, 4, seed=7, step=3)
    assert len(chosen) == 2 and all(len(g) == 2 for g in chosen)
    assert chosen == chosen_groups(groups, 4, seed=7, step=3)  # repeatable
    assert chosen_groups(groups, None, 7, 3) == groups
    assert [parse_turn_records(v) for v in ("all", "off", "12")] == [None, 0, 12]
    for bad in ("0", "-3", "some"):
        with pytest.raises(TurnRecordsError, match="--turn-records"):
            parse_turn_records(bad)


def test_a_trace_reads_while_streaming_and_a_resumed_run_continues_it(tmp_path):
    def event(name: str, ts: int) -> dict:
        return {"name": name, "cat": "step", "ph": "X", "ts": ts, "dur": 5, "pid": "rollout side", "tid": "steps"}

    writer = TraceWriter(tmp_path)
    writer.write([event("a", 10)])
    assert [e["name"] for e in load_trace(writer.path)] == ["process_name", "thread_name", "a"]  # no closing ] yet
    writer.write([event("b", 20)])
    writer.close()
    resumed = TraceWriter(tmp_path)
    resumed.write([event("c", 30), {**event("d", 40), "tid": "weights"}])
    resumed.close()
    events = json.loads(writer.path.read_text())
    assert [e["name"] for e in events if e["ph"] == "X"] == ["a", "b", "c", "d"]
    assert len({e["tid"] for e in events if e["ph"] == "X"}) == 2  # the resumed run kept the lane numbering


def test_a_run_without_dumps_still_gets_its_curves(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "rollout/reward_mean": 0.5}) + "\n")
    page = write_report(tmp_path).read_text()
    assert '"rollout/reward_mean":[[0,0.5]]' in page
    assert "no rollout dumps" in text_summary(tmp_path)


def test_a_saved_tensor_survives_the_round_trip(tmp_path):
    from slime_mt.types import TrainBatch

    s = two_turn_sample(0, 0)
    s.multimodal_train_inputs = {"pixel_values": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)}
    sequences, _ = finalize([s], "concat", False)
    batch = TrainBatch(sequences, [0.0], {}, {}, 0.0, 0.0, {}, [0], "")
    data = load_dump(save_dump(tmp_path / "d.pt", 0, [[s]], batch, {}))
    assert torch.equal(
        data["samples"][0]["multimodal_train_inputs"]["pixel_values"], s.multimodal_train_inputs["pixel_values"]
    )
    assert torch.equal(
        train_batch_of(data).samples[0].multimodal_train_inputs["pixel_values"],
        s.multimodal_train_inputs["pixel_values"],
    )
