"""Property: whatever a client sends, the embedded engine answers every request within a bound,
never with a 5xx for a client error, stays up, and keeps serving valid requests exactly.

Hypothesis draws arbitrary JSON bodies, valid bodies with fields replaced, deleted or wrapped into
batches, and byte-level corruptions of valid bodies, for ``/generate`` (text and VLM engines) and the
control endpoints; each example sends a few of them concurrently with a valid greedy request. The
engines serve copies of the tiny models with a short context, so no request can run for long.
``SLIME_MT_FUZZ_EXAMPLES`` scales the number of examples (CI runs the default, derandomized so it is
stable); ``SLIME_MT_FUZZ_RANDOM=1`` draws fresh examples each run, for exploring.
"""

import asyncio
import base64
import collections
import io
import json
import os

import httpx
import pytest
from engine_helpers import data_uri, diagram, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from slime_mt.engine.embedded.server import LocalEngine

EXAMPLES = int(os.environ.get("SLIME_MT_FUZZ_EXAMPLES", "60"))
BOUND = 30.0  # seconds within which every request must be answered
PROMPT = [9707, 1879, 11, 1128, 525, 498, 30]
PAD = 151655
VALID = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {"temperature": 0.0, "max_new_tokens": 4}}
FUZZ_SETTINGS = dict(
    deadline=None,
    derandomize=os.environ.get("SLIME_MT_FUZZ_RANDOM") != "1",
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)


def _short_context_copy(src, out, context: int):
    import shutil

    shutil.copytree(src, out, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    (config.get("text_config") or config)["max_position_embeddings"] = context
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def engines(tiny_paths, tmp_path_factory):
    text = _short_context_copy(tiny_paths["qwen2"], tmp_path_factory.mktemp("fuzz-text"), 64)
    vl = _short_context_copy(tiny_paths["qwen2.5-vl"], tmp_path_factory.mktemp("fuzz-vl"), 160)
    with LocalEngine(text, max_batch_size=8) as t, LocalEngine(vl, max_batch_size=8) as v:
        yield {"text": t, "vl": v}


# ---------------------------------------------------------------- strategies

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.integers(-3, 200)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)

SAMPLING_KEYS = [
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
    "logit_bias",
    "json_schema",
    "regex",
]
TOP_KEYS = [
    "input_ids",
    "text",
    "image_data",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "return_text_in_logprobs",
    "return_prompt_token_ids",
    "rid",
    "stream",
    "top_logprobs_num",
    "lora_path",
]


def _tiny_png(size) -> str:
    return data_uri(Image.new("RGB", size, (10, 200, 30)))


def _image_values():
    not_png = "data:image/png;base64," + base64.b64encode(b"not a png at all").decode()
    truncated = data_uri(diagram(4))[:200]
    buffer = io.BytesIO()
    Image.new("RGB", (3000, 2), (0, 0, 0)).save(buffer, format="PNG")  # an aspect ratio the processor refuses
    wide = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return st.sampled_from(
        [
            data_uri(diagram(1)),
            _tiny_png((28, 28)),
            _tiny_png((1, 1)),
            not_png,
            truncated,
            wide,
            "/dev/zero",
            "/etc/passwd",
            "/no/such/file.png",
            "file:///dev/null",
            "",
            "aGVsbG8=",
        ]
    )


def _plausible(key: str):
    """Values near the valid range for a known key, mixed with arbitrary JSON."""
    near = {
        "max_new_tokens": st.integers(-2, 80),
        "min_new_tokens": st.integers(-2, 10),
        "temperature": st.floats(-1, 3) | st.sampled_from([0.0, 1.0, 1e-9, float("inf"), float("nan")]),
        "top_p": st.floats(-0.5, 1.5) | st.just(float("nan")),
        "top_k": st.integers(-3, 200_000),
        "min_p": st.floats(-0.5, 1.5),
        "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
        "stop_token_ids": st.lists(st.integers(-5, 200_000), max_size=4),
        "sampling_seed": st.integers(-(2**66), 2**66),
        "input_ids": st.lists(st.integers(-2, 151_940), min_size=0, max_size=70)
        | st.lists(st.lists(st.integers(0, 151_935), max_size=6), max_size=3),
        "text": st.text(max_size=40) | st.lists(st.text(max_size=8), max_size=3),
        "rid": st.text(max_size=6) | st.lists(st.text(max_size=3), max_size=3),
        "logprob_start_len": st.integers(-3, 70),
        "image_data": _image_values() | st.lists(_image_values(), max_size=3),
    }.get(key, json_values)
    return near | json_values


@st.composite
def mutated_body(draw, base: dict):
    body = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["set", "delete", "sampling", "batch", "extra"]))
        if action == "set":
            key = draw(st.sampled_from(TOP_KEYS))
            body[key] = draw(_plausible(key))
        elif action == "delete" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        elif action == "sampling":
            params = body.setdefault("sampling_params", {})
            if isinstance(params, dict):
                key = draw(st.sampled_from(SAMPLING_KEYS) | st.text(max_size=6))
                params[key] = draw(_plausible(key))
        elif action == "batch" and isinstance(body.get("input_ids"), list):
            body["input_ids"] = [body["input_ids"]] * draw(st.integers(1, 3))
        else:
            body[draw(st.text(max_size=6))] = draw(json_values)
    return body


@st.composite
def corrupted_bytes(draw, base: dict):
    raw = bytearray(json.dumps(base).encode())
    kind = draw(st.sampled_from(["truncate", "flip", "insert"]))
    at = draw(st.integers(0, len(raw) - 1))
    if kind == "truncate":
        return bytes(raw[:at])
    if kind == "flip":
        raw[at] ^= draw(st.integers(1, 255))
        return bytes(raw)
    inserted = draw(st.binary(max_size=8) | st.sampled_from([b"NaN", b"-Infinity", b"[[[[", b"1e999"]))
    return bytes(raw[:at]) + inserted + bytes(raw[at:])


def generate_requests(base: dict):
    body = json_values | mutated_body(base) | st.builds(dict)
    return st.one_of(
        body.map(lambda b: ("POST", "/generate", b)), corrupted_bytes(base).map(lambda b: ("POST", "/generate", b))
    )


@st.composite
def control_request(draw, weight_paths: list[str]):
    """A control call, valid or hostile with equal odds; ``weight_paths[0]`` is a good checkpoint (the
    served weights), the others are not."""
    path = draw(
        st.sampled_from(
            [
                "/abort_request",
                "/pause_generation",
                "/continue_generation",
                "/update_weights_from_disk",
                "/flush_cache",
                "/health",
                "/server_info",
                "/model_info",
                "/health_generate",
                "/get_weight_version",
                "/no_such_endpoint",
            ]
        )
    )
    if path in ("/health", "/server_info", "/model_info", "/health_generate", "/get_weight_version"):
        return ("GET", path, None)
    valid = {
        "/abort_request": st.fixed_dictionaries(
            {"rid": st.text(max_size=4), "abort_all": st.sampled_from([True, False, "false", "true", "0", 1, None])}
        ),
        "/pause_generation": st.fixed_dictionaries({"mode": st.sampled_from(["abort", "in_place", "retract", None])}),
        "/update_weights_from_disk": st.fixed_dictionaries(
            {"model_path": st.just(weight_paths[0]), "weight_version": st.sampled_from(["0", None, ""])}
        ),
    }.get(path, st.just({}))
    hostile_base = {
        "/abort_request": {"rid": 5, "abort_all": "maybe"},
        "/pause_generation": {"mode": "nope"},
        "/update_weights_from_disk": {"model_path": draw(st.sampled_from(weight_paths[1:])), "weight_version": 5},
    }.get(path, {})
    if draw(st.booleans()):
        return ("POST", path, draw(valid))
    return ("POST", path, draw(st.just(hostile_base) | mutated_body(hostile_base) | json_values))


# ---------------------------------------------------------------- the property


async def _send(http: httpx.AsyncClient, url: str, method: str, path: str, body) -> httpx.Response:
    if method == "GET":
        return await http.get(url + path)
    if isinstance(body, bytes):
        return await http.post(url + path, content=body, headers={"content-type": "application/json"})
    return await http.post(url + path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


async def _round(url: str, fuzz: list[tuple], valid: dict, reference: list[int], seen: collections.Counter) -> None:
    async with httpx.AsyncClient(timeout=BOUND) as http:

        async def fuzzed(method, path, body):
            response = await _send(http, url, method, path, body)
            if path == "/pause_generation" and response.status_code == 200:  # a pause that took effect is
                await http.post(url + "/continue_generation")  # lifted at once; a refused one must change nothing
            return response

        answers = await asyncio.gather(
            http.post(url + "/generate", json=valid), *(fuzzed(*request) for request in fuzz)
        )
        await http.post(url + "/continue_generation")
        for (_, path, body), response in zip(fuzz, answers[1:]):
            seen[(path, response.status_code)] += 1
            assert response.status_code < 500, (
                path,
                body if not isinstance(body, bytes) else body[:200],
                response.status_code,
                response.text[:500],
            )
            if response.status_code >= 400 and path != "/no_such_endpoint" and response.status_code != 405:
                assert response.json()["error"]["message"], (path, body)
        valid_answer = answers[0]
        assert valid_answer.status_code == 200, valid_answer.text
        out = valid_answer.json()
        if out["meta_info"]["finish_reason"]["type"] == "abort":  # a fuzzed abort_all or pause hit it
            assert out["output_ids"] == reference[: len(out["output_ids"])]
        else:
            assert out["output_ids"] == reference
        assert (await http.get(url + "/health")).status_code == 200


def _reference(url: str, body: dict) -> list[int]:
    response = httpx.post(url + "/generate", json=body, timeout=BOUND)
    assert response.status_code == 200, response.text
    return response.json()["output_ids"]


def _assert_idle(url: str) -> None:
    state = httpx.get(url + "/server_info", timeout=BOUND).json()["internal_states"][0]
    assert state["#running_req"] == 0 and state["#queue_req"] == 0 and not state["paused"], state


def _exercised(seen: collections.Counter, path: str) -> None:
    """The fuzz reached both sides of ``path``: requests served (200) and requests refused (4xx)."""
    statuses = {status for (p, status), n in seen.items() if p == path}
    assert 200 in statuses and any(400 <= s < 500 for s in statuses), (path, dict(seen))


def _fuzz(url: str, requests, valid: dict, examples: int, exercised: tuple[str, ...]) -> None:
    """Run the property on ``url``: lists of ``requests`` sent with ``valid``; then the fuzz must have
    reached both sides of each ``exercised`` path, and the engine serves ``valid`` as before, idle."""
    reference = _reference(url, valid)
    seen = collections.Counter()

    @settings(max_examples=examples, **FUZZ_SETTINGS)
    @given(requests)
    def prop(fuzz):
        run(asyncio.wait_for(_round(url, fuzz, valid, reference, seen), 4 * BOUND))

    prop()
    for path in exercised:
        _exercised(seen, path)
    assert _reference(url, valid) == reference
    _assert_idle(url)


def test_generate_fuzz_text(engines):
    _fuzz(
        engines["text"].url,
        st.lists(generate_requests(VALID), min_size=1, max_size=4),
        VALID,
        EXAMPLES * 3,
        ("/generate",),
    )


def test_generate_fuzz_vl(engines):
    image_body = {
        "input_ids": [151652, PAD, 151653, *PROMPT],
        "image_data": [data_uri(diagram(2))],
        "return_logprob": True,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 3},
    }
    _fuzz(
        engines["vl"].url,
        st.lists(generate_requests(image_body), min_size=1, max_size=3),
        image_body,
        EXAMPLES,
        ("/generate",),
    )


def test_control_fuzz(engines, tmp_path_factory):
    engine = engines["text"]
    root = tmp_path_factory.mktemp("fuzz-weights")
    (root / "empty").mkdir()
    (root / "corrupt").mkdir()
    (root / "corrupt" / "model.safetensors").write_bytes(b"\x00" * 16)
    paths = [str(engine.model_path), str(root / "empty"), str(root / "corrupt"), "/dev", "/no/such/folder", ""]
    _fuzz(
        engine.url,
        st.lists(control_request(paths), min_size=1, max_size=4),
        VALID,
        EXAMPLES * 2,
        ("/abort_request", "/pause_generation", "/update_weights_from_disk"),
    )
