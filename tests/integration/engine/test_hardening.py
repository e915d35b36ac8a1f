"""One test per engine defect of issue 10: hostile input never hangs or 5xxs the embedded engine,
failed weight updates change nothing, ``min_new_tokens`` blocks EOS, and the SGLang contract gaps."""

import asyncio
import json
import os
import struct
import threading
import time
import zlib

import httpx
import pytest
import torch
from engine_helpers import diagram, eager_to_stop_model, run
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from slime_mt.engine.embedded.server import LocalEngine
from slime_mt.engine.protocol import GenerateRequest, SamplingParams

PROMPT = [9707, 1879, 11, 1128, 525, 498, 30]
EOS = 151645
GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
TIMEOUT = 60.0
GREEDY_BODY = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": GREEDY}


@pytest.fixture(scope="module")
def engine(tiny_paths):
    with LocalEngine(tiny_paths["qwen2"], max_batch_size=8) as e:
        yield e


@pytest.fixture(scope="module")
def vl_engine(tiny_paths):
    with LocalEngine(tiny_paths["qwen2.5-vl"], max_batch_size=8) as e:
        yield e


def post(url: str, path: str, body=None, content: bytes | None = None, timeout: float = TIMEOUT) -> httpx.Response:
    if content is not None:
        return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=timeout)
    return httpx.post(url + path, json=body, timeout=timeout)


def greedy(url: str, n: int = 8) -> dict:
    response = post(
        url,
        "/generate",
        {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {**GREEDY, "max_new_tokens": n}},
    )
    assert response.status_code == 200, response.text
    return response.json()


def assert_idle(url: str) -> None:
    """Nothing is left running or queued (every admitted request was answered)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state = httpx.get(url + "/server_info", timeout=10).json()["internal_states"][0]
        if state["#running_req"] == 0 and state["#queue_req"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {state}")


# ---------------------------------------------------------------- 1. one bad request, everyone answered


def test_seed_beyond_64_bits_fails_alone(engine):
    reference = greedy(engine.url, 30)

    async def go():
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            valid = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 30}}
            running = asyncio.create_task(http.post(engine.url + "/generate", json=valid))
            await asyncio.sleep(0.2)
            bad = await http.post(
                engine.url + "/generate", json={"input_ids": PROMPT, "sampling_params": {"sampling_seed": 2**70}}
            )
            after = await http.post(engine.url + "/generate", json=valid)
            return bad, await running, after

    bad, running, after = run(asyncio.wait_for(go(), TIMEOUT))
    assert bad.status_code == 400 and "sampling_seed" in bad.json()["error"]["message"]
    assert running.status_code == 200 and running.json()["output_ids"] == reference["output_ids"]
    assert after.status_code == 200 and after.json()["output_ids"] == reference["output_ids"]
    assert_idle(engine.url)


def test_batch_with_rejected_members_answers_and_leaks_nothing(engine):
    too_long = "hello " * 5000  # more tokens than the context
    response = post(
        engine.url,
        "/generate",
        {"text": [too_long, "Hello world", too_long], "sampling_params": {"max_new_tokens": 20}},
    )
    assert response.status_code == 400
    assert "context length" in response.json()["error"]["message"]
    assert_idle(engine.url)
    greedy(engine.url)


def test_a_cancelled_future_rejected_at_admission_does_not_stop_the_loop(engine):
    """The HTTP side may give up on a future (a client gone); settling it later must not break the loop
    and the requests admitted with it are still answered."""
    scheduler = engine.scheduler
    scheduler.pause("in_place")
    try:
        bad = GenerateRequest(
            rid="bad", input_ids=[1] * 5000, text=None, images=[], sampling=SamplingParams(max_new_tokens=4)
        )
        good = GenerateRequest(
            rid="good",
            input_ids=PROMPT,
            text=None,
            images=[],
            sampling=SamplingParams(max_new_tokens=4, temperature=0.0),
        )
        bad_future = scheduler.submit(bad)
        good_future = scheduler.submit(good)
        assert bad_future.cancel()
    finally:
        scheduler.resume()
    assert good_future.result(timeout=TIMEOUT)["output_ids"] == greedy(engine.url, 4)["output_ids"]
    assert_idle(engine.url)


def test_engine_faults_fail_only_their_request_with_a_named_500(engine, monkeypatch):
    """Fault injection: a prefill that raises (one marked request) and a decode step that raises once."""
    runner = engine.scheduler.runner
    prefill, decode = runner.prefill, runner.decode
    marker = 42
    broken = {"decode": True}

    def faulty_prefill(seq, *args, **kwargs):
        if seq.prompt_ids[0] == marker:
            raise RuntimeError("injected prefill fault")
        return prefill(seq, *args, **kwargs)

    def faulty_decode(batch):
        if broken["decode"] and any(s.prompt_ids[0] == marker + 1 for s in batch.seqs):
            broken["decode"] = False
            raise RuntimeError("injected decode fault")
        return decode(batch)

    monkeypatch.setattr(runner, "prefill", faulty_prefill)
    monkeypatch.setattr(runner, "decode", faulty_decode)
    reference = greedy(engine.url)
    first = post(engine.url, "/generate", {"input_ids": [marker, *PROMPT], "sampling_params": GREEDY})
    assert first.status_code == 500
    assert "injected prefill fault" in first.json()["error"]["message"]
    second = post(engine.url, "/generate", {"input_ids": [marker + 1, *PROMPT], "sampling_params": GREEDY})
    assert second.status_code == 500
    assert "RuntimeError: injected decode fault" in second.json()["error"]["message"]
    assert greedy(engine.url)["output_ids"] == reference["output_ids"]
    assert_idle(engine.url)


# ---------------------------------------------------------------- 2. weight updates are all-or-nothing


def _bad_checkpoints(root, good: dict[str, torch.Tensor]) -> dict[str, str]:
    names = sorted(good)
    cases = {}
    folder = root / "bad_name_after_good"
    folder.mkdir()
    save_file(
        {**{n: good[n] + 1.0 for n in names}, "model.layers.9.nonexistent.weight": torch.zeros(2)},
        str(folder / "model.safetensors"),
    )
    cases["bad_name_after_good"] = str(folder)
    folder = root / "bad_shape"
    folder.mkdir()
    shapes = {n: good[n] + 1.0 for n in names}
    shapes[names[-1]] = torch.zeros(3, 3)
    save_file(shapes, str(folder / "model.safetensors"))
    cases["bad_shape"] = str(folder)
    folder = root / "bad_dtype"
    folder.mkdir()
    save_file(
        {**{n: good[n] + 1.0 for n in names[:-1]}, names[-1]: torch.ones(good[names[-1]].shape, dtype=torch.int64)},
        str(folder / "model.safetensors"),
    )
    cases["bad_dtype"] = str(folder)
    folder = root / "corrupt"
    folder.mkdir()
    save_file({n: good[n] + 1.0 for n in names[:2]}, str(folder / "a.safetensors"))
    (folder / "b.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}garbage")
    cases["corrupt"] = str(folder)
    folder = root / "empty_file"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    cases["empty_file"] = str(folder)
    folder = root / "bad_index"
    folder.mkdir()
    save_file({n: good[n] + 1.0 for n in names}, str(folder / "model-00001.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00002.safetensors"}}))
    cases["bad_index"] = str(folder)
    cases["missing_path"] = str(root / "does-not-exist")
    cases["a_file_not_a_folder"] = str(root / "bad_shape" / "model.safetensors")
    return cases


def test_failed_updates_leave_weights_and_version_then_a_good_one_works(tiny_paths, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_paths["qwen2"]))
    good = {k: v.clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    cases = _bad_checkpoints(tmp_path, good)
    with LocalEngine(tiny_paths["qwen2"]) as engine:
        before = greedy(engine.url)
        for label, path in cases.items():
            response = post(engine.url, "/update_weights_from_disk", {"model_path": path, "weight_version": label})
            assert response.status_code == 400, (label, response.status_code, response.text)
            message = response.json()["error"]["message"]
            assert path in message or os.path.basename(path) in message or "model.safetensors" in message, (
                label,
                message,
            )
            now = greedy(engine.url)
            assert now["output_ids"] == before["output_ids"], label
            assert [x[0] for x in now["meta_info"]["output_token_logprobs"]] == [
                x[0] for x in before["meta_info"]["output_token_logprobs"]
            ], label
            assert now["meta_info"]["weight_version"] == "0", label
        torch.manual_seed(3)
        perturbed = tmp_path / "perturbed"
        perturbed.mkdir()
        save_file({k: v + 0.5 * torch.randn_like(v) for k, v in good.items()}, str(perturbed / "model.safetensors"))
        ok = post(engine.url, "/update_weights_from_disk", {"model_path": str(perturbed), "weight_version": "7"})
        assert ok.status_code == 200 and ok.json()["weight_version"] == "7"
        after = greedy(engine.url)
        assert after["output_ids"] != before["output_ids"] and after["meta_info"]["weight_version"] == "7"


def test_failed_in_process_update_changes_nothing(tiny_paths):
    from slime_mt.errors import WeightUpdateError

    model = AutoModelForCausalLM.from_pretrained(str(tiny_paths["qwen2"]))
    named = {k: v + 1.0 for k, v in model.state_dict().items()}
    named["model.norm.weight"] = torch.zeros(5)
    with LocalEngine(tiny_paths["qwen2"]) as engine:
        before = greedy(engine.url)
        with pytest.raises(WeightUpdateError, match=r"model.norm.weight.*shape \(5,\)"):
            engine.update_weights_from_tensors(named, weight_version="1")
        assert greedy(engine.url)["output_ids"] == before["output_ids"]
        assert engine.weight_version == "0"


# ---------------------------------------------------------------- 3. malformed input is a 400, never a 5xx


@pytest.mark.parametrize(
    "raw,needle",
    [
        (b'{"input_ids": [1, 2], "return_logprob": true, "sampling_params": {"temperature": NaN}}', "temperature"),
        (b'{"input_ids": [1, 2], "sampling_params": {"temperature": Infinity}}', "temperature"),
        (b'{"input_ids": [1, 2], "sampling_params": {"temperature": 1e999}}', "temperature"),
        (b'{"input_ids": [1, 2], "sampling_params": {"top_p": NaN}}', "top_p"),
        (b'{"input_ids": [1, 2], "sampling_params": {"min_p": -Infinity}}', "min_p"),
        (b'{"input_ids": [1, 2], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
        (b"[" * 5000 + b"]" * 5000, "nested"),
        (b'{"input_ids": [' + b"9" * 5000 + b"]}", "JSON"),
        (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": ' + b"9" * 400 + b"}}", "max_new_tokens"),
    ],
)
def test_malformed_numbers_and_nesting_are_400(engine, raw, needle):
    response = post(engine.url, "/generate", content=raw)
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]
    greedy(engine.url)


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width x height`` 1-bit pixels with almost no data (a decompression bomb)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize(
    "width,height,needle", [(100_000, 100_000, "pixels"), (9_000, 9_000, "pixels"), (64, 64, "cannot read image")]
)
def test_image_bombs_and_truncated_images_are_400(vl_engine, width, height, needle):
    import base64

    uri = "data:image/png;base64," + base64.b64encode(_png_header_only(width, height)).decode()
    response = post(vl_engine.url, "/generate", {"input_ids": [1, 151655], "image_data": [uri]})
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]


def test_image_files_must_be_small_regular_files_read_off_the_event_loop(vl_engine, tmp_path):
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    big = tmp_path / "big.png"
    with open(big, "wb") as f:
        f.truncate(200 * 1024 * 1024)  # sparse: no disk used
    for path, needle in [
        ("/dev/zero", "not a regular file"),
        (str(fifo), "not a regular file"),
        (f"file://{fifo}", "not a regular file"),
        (str(big), "larger than"),
        (str(tmp_path), "not a regular file"),
    ]:
        started = time.perf_counter()
        response = post(vl_engine.url, "/generate", {"input_ids": [1, 151655], "image_data": [path]}, timeout=20)
        assert response.status_code == 400, (path, response.text)
        assert needle in response.json()["error"]["message"], (path, response.text)
        assert time.perf_counter() - started < 10, path
    image = tmp_path / "ok.png"
    diagram(1).save(image)
    ok = post(
        vl_engine.url,
        "/generate",
        {"input_ids": [1, 151655], "image_data": [str(image)], "sampling_params": {"max_new_tokens": 2}},
    )
    assert ok.status_code == 200, ok.text


# ---------------------------------------------------------------- 4. min_new_tokens blocks every stop token


@pytest.fixture(scope="module")
def stopper(tiny_paths, tmp_path_factory):
    """An engine on a model that wants to emit EOS (and, second, token 100) at every step."""
    path = eager_to_stop_model(tiny_paths["qwen2"], tmp_path_factory.mktemp("stopper"), EOS, runner_up=100)
    with LocalEngine(path) as e:
        yield e


def test_the_stopper_model_stops_at_once(stopper):
    out = post(stopper.url, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}).json()
    assert out["output_ids"] == [EOS]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.0},
        {"temperature": 1.0, "sampling_seed": 5},
        {"temperature": 1.5, "top_p": 0.9, "sampling_seed": 6},
    ],
)
def test_min_new_tokens_blocks_eos_and_stop_token_ids(stopper, sampling):
    body = {
        "input_ids": [PROMPT] * 4,
        "return_logprob": True,
        "sampling_params": [
            {**sampling, "max_new_tokens": 12, "min_new_tokens": m, "stop_token_ids": [100]} for m in (1, 3, 6, 10)
        ],
    }
    outs = post(stopper.url, "/generate", body).json()
    for m, out in zip((1, 3, 6, 10), outs):
        ids = out["output_ids"]
        assert not {EOS, 100} & set(ids[:m]), (m, ids)
        assert len(ids) == m + 1 and ids[m] in (EOS, 100), (m, ids)  # it stops as soon as it may
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[m]}


def test_min_new_tokens_logprobs_are_under_the_masked_distribution(stopper, tiny_paths):
    """As SGLang reports them: the blocked tokens get -inf before log_softmax(logits / T)."""
    out = post(
        stopper.url,
        "/generate",
        {
            "input_ids": PROMPT,
            "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "min_new_tokens": 4},
        },
    ).json()
    ids = out["output_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(stopper.model_path)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1 : -1].float()  # [n, V]
    logits[:4, EOS] = float("-inf")
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
    got = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, expected, atol=1e-4), (got, expected)


# ---------------------------------------------------------------- 5. contract gaps with SGLang's /generate


def test_null_sampling_params_mean_their_defaults(engine):
    nulls = {
        k: None
        for k in (
            "max_new_tokens",
            "min_new_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "stop",
            "stop_token_ids",
            "ignore_eos",
            "skip_special_tokens",
            "no_stop_trim",
            "sampling_seed",
            "n",
            "frequency_penalty",
            "stream_interval",
        )
    }
    nulls.update(temperature=0.0, max_new_tokens=8)
    response = post(
        engine.url,
        "/generate",
        {"input_ids": PROMPT, "sampling_params": nulls, "return_logprob": None, "logprob_start_len": None, "rid": None},
    )
    assert response.status_code == 200, response.text
    assert response.json()["output_ids"] == greedy(engine.url)["output_ids"]
    unlimited = post(
        engine.url,
        "/generate",
        {
            "input_ids": PROMPT,
            "sampling_params": {
                "max_new_tokens": None,
                "temperature": 0.0,
                "stop_token_ids": [greedy(engine.url, 3)["output_ids"][2]],
            },
        },
    )
    assert unlimited.status_code == 200, unlimited.text


def test_input_token_logprobs_with_the_default_start(engine):
    out = post(engine.url, "/generate", {"input_ids": PROMPT, "return_logprob": True, "sampling_params": GREEDY}).json()
    assert out["meta_info"]["input_token_logprobs"] == [[None, PROMPT[-1], None]]
    full = post(
        engine.url,
        "/generate",
        {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0, "sampling_params": GREEDY},
    ).json()["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in full] == PROMPT and full[0][0] is None and all(lp < 0 for lp, _, _ in full[1:])
    part = post(
        engine.url,
        "/generate",
        {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 3, "sampling_params": GREEDY},
    ).json()["meta_info"]["input_token_logprobs"]
    assert part[0] == [None, PROMPT[3], None] and part[1:] == full[4:]
    too_far = post(
        engine.url,
        "/generate",
        {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": len(PROMPT), "sampling_params": GREEDY},
    )
    assert too_far.status_code == 400 and "logprob_start_len" in too_far.json()["error"]["message"]


def _memory_mb(field: str) -> int:
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1]) // 1024


def test_a_huge_text_is_refused_at_once_and_a_long_prompts_input_logprobs_come_in_chunks(engine, tiny_paths):
    """Issue 67, item 2: a 10 MB text is refused before it is tokenized (400 naming the limit, at once, the
    scheduler free); a 4,088-token prompt's input log-probs are projected a chunk of positions at a time
    between decode steps: they equal a full log-softmax, the engine holds under 500 MB more than idle
    (not [4088, 151936] logits), and short requests are answered while they are computed. Integration
    tier, ~15 s (the 4,088 x 151,936 projection on one core); its latency is measured by
    benchmarks/engine_long_prompt.py, not here."""
    short = PROMPT * 40  # 280 tokens, four chunks of input log-probs at 70 rows each
    runner = engine.scheduler.runner
    rows, runner.logprob_chunk_rows = runner.logprob_chunk_rows, 70
    try:
        got = post(
            engine.url,
            "/generate",
            {
                "input_ids": short,
                "return_logprob": True,
                "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 0},
            },
        ).json()["meta_info"]["input_token_logprobs"]
    finally:
        runner.logprob_chunk_rows = rows
    model = AutoModelForCausalLM.from_pretrained(str(tiny_paths["qwen2"]), dtype=torch.float32).eval()
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([short])).logits[0, :-1], -1)
    want = full.gather(-1, torch.tensor(short[1:])[:, None])[:, 0]
    assert got[0][0] is None and len(got) == len(short)
    assert float((torch.tensor([lp for lp, _, _ in got[1:]]) - want).abs().max()) < 1e-5
    started = time.perf_counter()
    huge = post(engine.url, "/generate", {"text": "hello world " * (10 * 2**20 // 12), "sampling_params": GREEDY})
    assert huge.status_code == 400 and time.perf_counter() - started < 5
    assert "characters is longer than the model's context length (4096 tokens)" in huge.json()["error"]["message"]
    ids = torch.randint(100, 150000, (4088,), generator=torch.Generator().manual_seed(0)).tolist()
    with open("/proc/self/clear_refs", "w") as fh:  # the peak from here on
        fh.write("5")
    idle, answered, stop = _memory_mb("VmRSS"), [], threading.Event()

    def others():
        while not stop.is_set():
            greedy(engine.url, 2)
            answered.append(time.perf_counter())

    beside = threading.Thread(target=others)
    beside.start()
    started = time.perf_counter()
    long = post(
        engine.url,
        "/generate",
        {
            "input_ids": ids,
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {**GREEDY, "max_new_tokens": 1},
        },
    )
    finished = time.perf_counter()
    stop.set()
    beside.join()
    assert long.status_code == 200 and len(long.json()["meta_info"]["input_token_logprobs"]) == 4088
    assert _memory_mb("VmHWM") - idle < 500
    assert sum(started < t < finished for t in answered) >= 3  # served while the long prompt's were computed
    assert_idle(engine.url)


def test_batch_rid_string_is_a_prefix_and_abort_hits_one(engine):
    body = {
        "input_ids": [PROMPT, PROMPT[:4]],
        "rid": "job",
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
    }

    async def go():
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            task = asyncio.create_task(http.post(engine.url + "/generate", json=body))
            await asyncio.sleep(0.5)
            aborted = await http.post(engine.url + "/abort_request", json={"rid": "job_1"})
            return aborted, await task

    aborted, response = run(asyncio.wait_for(go(), TIMEOUT))
    assert aborted.json()["aborted"] == 1
    first, second = response.json()
    assert [first["meta_info"]["id"], second["meta_info"]["id"]] == ["job_0", "job_1"]
    assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 400}
    assert second["meta_info"]["finish_reason"]["type"] == "abort"
    duplicate = post(engine.url, "/generate", {"input_ids": [PROMPT, PROMPT], "rid": ["a", "a"]})
    assert duplicate.status_code == 400 and "Duplicate request IDs" in duplicate.json()["error"]["message"]


@pytest.mark.parametrize("flag,aborts", [("false", False), ("0", False), (False, False), ("true", True), (1, True)])
def test_abort_all_is_read_as_a_boolean(engine, flag, aborts):
    """A long request, then ``abort_all: flag``, then an abort by its rid: the finish message says
    which of the two ended it (a fixed-length request could finish first on a fast machine)."""

    async def go():
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            task = asyncio.create_task(
                http.post(
                    engine.url + "/generate",
                    json={
                        "input_ids": PROMPT,
                        "rid": "long",
                        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
                    },
                )
            )
            await asyncio.sleep(0.3)
            answer = await http.post(engine.url + "/abort_request", json={"rid": "", "abort_all": flag})
            await asyncio.sleep(0.1)
            await http.post(engine.url + "/abort_request", json={"rid": "long"})
            return answer, await task

    answer, response = run(asyncio.wait_for(go(), TIMEOUT))
    assert answer.status_code == 200
    finish = response.json()["meta_info"]["finish_reason"]
    assert finish == {"type": "abort", "message": "Abort requested" if aborts else "Abort requested for rid long"}
    bad = post(engine.url, "/abort_request", {"rid": "x", "abort_all": "maybe"})
    assert bad.status_code == 400 and "abort_all" in bad.json()["error"]["message"]


BAD_CONTROL_BODIES = [
    ("/pause_generation", {"mode": "bogus"}),
    ("/pause_generation", {"mode": 3}),
    ("/pause_generation", {"mode": ["abort"]}),
    ("/pause_generation", b"[1, 2]"),
    ("/pause_generation", b"{not json"),
    ("/abort_request", {"rid": 5}),
    ("/abort_request", {"abort_all": "maybe"}),
    ("/abort_request", {}),
    ("/update_weights_from_disk", {"model_path": "/no/such/folder", "weight_version": "9"}),
    ("/update_weights_from_disk", {"model_path": 7}),
    ("/update_weights_from_disk", {"model_path": "/dev", "weight_version": "9"}),
    ("/init_weights_update_group", {"master_address": "", "master_port": 1, "rank_offset": 1, "world_size": 2}),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "x", "rank_offset": 0}),
    ("/update_weights_from_distributed", {"group_name": "never-joined", "names": ["x"]}),
    ("/destroy_weights_update_group", {"group_name": "never-joined"}),
    ("/update_weights_from_tensor", {"serialized_named_tensors": "not a list"}),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["garbage"], "weight_version": "9"}),
    ("/release_memory_occupation", {"tags": ["weights", "everything"]}),
    ("/release_memory_occupation", {"tags": "weights"}),
    ("/resume_memory_occupation", {"tags": [1]}),
]
BODILESS = ("/flush_cache", "/continue_generation")  # as SGLang's, they read no body: garbage is ignored


def test_a_refused_control_request_changes_nothing(engine):
    """Issue 44 item 0: every control endpoint with bad bodies, each refused (4xx naming the cause),
    then a valid generation served at once and alike: nothing paused, released, aborted or loaded."""
    reference = greedy(engine.url)
    assert_idle(engine.url)
    for path, body in [*BAD_CONTROL_BODIES, *((path, b"\xff{") for path in BODILESS)]:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        refused = post(engine.url, path, content=content, timeout=10)
        if path in BODILESS:
            assert refused.status_code == 200, (path, refused.text)
        else:
            answer = refused.json()  # weight calls answer as SGLang's do: success false and the message
            message = answer["message"] if answer.get("success") is False else answer["error"]["message"]
            assert 400 <= refused.status_code < 500 and message, (path, body, refused.text)
        state = httpx.get(engine.url + "/server_info", timeout=10).json()["internal_states"][0]
        assert not state["paused"], (path, body)
        after = post(engine.url, "/generate", GREEDY_BODY, timeout=10)  # 10 s: a closed admission hangs here
        assert after.status_code == 200, (path, body, after.text)
        assert after.json()["output_ids"] == reference["output_ids"], (path, body)
        assert after.json()["meta_info"]["weight_version"] == reference["meta_info"]["weight_version"], (path, body)
    assert_idle(engine.url)


def test_update_without_weight_version_keeps_the_version(tiny_paths, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_paths["qwen2"]))
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
        str(tmp_path / "model.safetensors"),
    )
    with LocalEngine(tiny_paths["qwen2"], weight_version="3") as engine:
        answer = post(engine.url, "/update_weights_from_disk", {"model_path": str(tmp_path)}).json()
        assert answer["success"] and answer["weight_version"] == "3"
        assert greedy(engine.url)["meta_info"]["weight_version"] == "3"
        engine.update_weights_from_tensors({"model.norm.weight": model.model.norm.weight.detach()})
        assert engine.weight_version == "3"
        bad = post(engine.url, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": 4})
        assert bad.status_code == 400 and "weight_version" in bad.json()["error"]["message"]


def test_image_reads_do_not_block_the_event_loop(vl_engine, tmp_path, monkeypatch):
    """A slow image read (a file on a slow disk) runs off the event loop: /health answers meanwhile."""
    import slime_mt.engine.images as images

    slow = threading.Event()
    real = images._read_image_file

    def slow_read(path, limit):
        slow.set()
        time.sleep(2.0)
        return real(path, limit)

    monkeypatch.setattr(images, "_read_image_file", slow_read)
    image = tmp_path / "ok.png"
    diagram(2).save(image)

    async def go():
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            task = asyncio.create_task(
                http.post(
                    vl_engine.url + "/generate",
                    json={
                        "input_ids": [1, 151655],
                        "image_data": [str(image)],
                        "sampling_params": {"max_new_tokens": 1},
                    },
                )
            )
            while not slow.is_set():
                await asyncio.sleep(0.01)
            started = time.perf_counter()
            health = await http.get(vl_engine.url + "/health")
            return time.perf_counter() - started, health, await task

    waited, health, response = run(asyncio.wait_for(go(), TIMEOUT))
    assert health.status_code == 200 and waited < 1.0
    assert response.status_code == 200


def test_health_reports_a_dead_scheduler(tiny_paths):
    engine = LocalEngine(tiny_paths["qwen2"]).start()
    try:
        assert httpx.get(engine.url + "/health", timeout=10).status_code == 200
        engine.scheduler.stop()
        response = httpx.get(engine.url + "/health", timeout=10)
        assert response.status_code == 503
        generate = post(engine.url, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}, timeout=10)
        assert generate.status_code == 503
    finally:
        engine.stop()


def test_on_vllm_failed_updates_are_refused_and_change_nothing(vllm_target, tmp_path):
    """vLLM's in-place reload stops the engine on a tensor it cannot load; the client checks a folder
    against the served checkpoint first, so every bad folder is a 400 naming it, the engine keeps
    serving the same weights and version, and a good folder then loads and serves exactly its weights
    (an LM head tied to the embedding too, which vLLM's CPU build keeps packed from the old ones unless
    slime_mt's worker extension packs it again)."""
    from safetensors.torch import load_file

    from slime_mt.errors import EngineRequestError

    good = load_file(str(vllm_target.model_path / "model.safetensors"))
    cases = _bad_checkpoints(tmp_path, good)

    async def greedy_on(client):
        return await client.generate(PROMPT, dict(GREEDY))

    async def go():
        async with vllm_target.client() as client:
            before = await greedy_on(client)
            for label, path in cases.items():
                with pytest.raises(EngineRequestError) as refused:
                    await client.update_weights_from_disk(path, weight_version=label)
                assert refused.value.status == 400, label
                assert path in refused.value.message or "model.safetensors" in refused.value.message, (label, refused)
                now = await greedy_on(client)
                assert now["output_ids"] == before["output_ids"], label
                assert now["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"], label
                assert now["meta_info"]["weight_version"] == "0", label
            (answer,) = await client.update_weights_from_disk(str(perturbed), weight_version="7")
            after = await greedy_on(client)
            (tmp_path / "original").mkdir()
            save_file(good, str(tmp_path / "original" / "model.safetensors"))
            await client.update_weights_from_disk(str(tmp_path / "original"), weight_version="0")
            return before, answer, after, await greedy_on(client)

    torch.manual_seed(3)
    perturbed = tmp_path / "perturbed"
    perturbed.mkdir()
    new_weights = {k: v + 0.5 * torch.randn_like(v) for k, v in good.items()}  # the tied embedding too
    save_file(new_weights, str(perturbed / "model.safetensors"))
    before, answer, after, back = run(go())
    assert answer["success"] and answer["weight_version"] == "7"
    assert after["output_ids"] != before["output_ids"] and after["meta_info"]["weight_version"] == "7"
    # the reloaded server serves exactly the new weights (the embedded engine's greedy decoding by them),
    # and exactly the old ones once they are back
    with LocalEngine(vllm_target.model_path) as reference:
        reference.update_weights_from_tensors(new_weights, weight_version="7")
        expected = httpx.post(reference.url + "/generate", json=_greedy_body(), timeout=60).json()
    assert after["output_ids"] == expected["output_ids"]
    assert [t[0] for t in after["meta_info"]["output_token_logprobs"]] == pytest.approx(
        [t[0] for t in expected["meta_info"]["output_token_logprobs"]], abs=1e-4
    )
    assert back["output_ids"] == before["output_ids"] and back["meta_info"]["weight_version"] == "0"


def _greedy_body() -> dict:
    return {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True}


def test_on_vllm_a_request_whose_engine_was_lost_is_generated_again_on_another(vllm_target):
    """Several vLLM engines have no router: the client keeps a trajectory on one engine. When that engine
    is lost (``--ray``: the supervisor takes it out of the rotation), the request it was serving fails
    over to an engine left, as the same request from its start, and the trajectory's later turns go
    there; an engine admitted again takes new trajectories."""
    from slime_mt.engine.clients.vllm import VLLMClient
    from slime_mt.engine.launch import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: an engine whose process died
    live = vllm_target.url

    async def go():
        async with VLLMClient(dead, [dead, live], max_retries=2, backoff=0.2) as client:
            assert client._engine_for("t") == dead  # the least loaded, first: the trajectory's engine
            turn = asyncio.ensure_future(client.generate(PROMPT, dict(GREEDY), route="t"))
            await asyncio.sleep(0.1)  # the request is retrying against the lost engine
            client.leave(dead)  # the supervisor's on_lost
            answer = await turn
            later = client._engine_for("t")
            client.enter(dead)  # started again, with the current weights
            rotation = list(client.rotation)
            client.leave(live)
            return answer, later, client._engine_for("new"), rotation

    answer, later, fresh, rotation = run(go())

    async def reference():
        async with VLLMClient(live) as client:
            return await client.generate(PROMPT, dict(GREEDY))

    assert answer["output_ids"] == run(reference())["output_ids"]
    assert later == live and rotation == [live, dead] and fresh == dead
