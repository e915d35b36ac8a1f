"""vLLM behind the rollout's client contract (``--engine vllm``): ``VLLMClient`` speaks vLLM's HTTP API
and answers as ``EngineClient`` does, in SGLang's shapes, so nothing above the client knows which
engine runs.

Generation goes to vLLM's token-in/token-out endpoint, ``POST /inference/v1/generate`` (served with
``--enable-scale-out``), not to ``/v1/completions`` with ``return_token_ids``. Both take token ids and
return the exact output ids with one log-prob per token, but only the generate endpoint reports
which weights sampled each token (``weight_versions``: ``[start, end)`` spans over the output, the
version set by ``/update_weight_version``); completions report no version, and a client that
inferred it from the order of its own calls would be wrong for a request that spans an update. It
also takes vLLM's ``SamplingParams`` as they are, and its ids are not re-tokenized.

- Sampling parameters: SGLang's names map to vLLM's (``max_new_tokens`` -> ``max_tokens``,
  ``sampling_seed`` -> ``seed``, ``no_stop_trim`` -> ``include_stop_str_in_output``, ...); one vLLM
  cannot honour (structured output, ``stop_regex``, ``n`` > 1) is an ``EngineRequestError`` naming it.
- Log-probs: servers run with ``--logprobs-mode processed_logprobs``, so a token's log-prob is
  ``log_softmax(logits / T)`` as SGLang's, and what the trainer recomputes; vLLM renormalises over
  the tokens top-k/top-p keep, so with ``top_p < 1`` or ``top_k`` the two differ (RL keeps them off).
- Finish reasons: ``stop`` (``matched``: the stop string or token id, the EOS id otherwise),
  ``length`` and ``abort`` as SGLang's ``meta_info.finish_reason``.
- Weight versions: ``meta_info.weight_version`` is the version of the last span; a response whose
  tokens span an update (a pause in ``keep`` mode) carries the spans in ``weight_version_spans``.
- Aborts: vLLM names a request ``generate-tokens-{rid}``; ``abort`` sends that name, or nothing
  (every request) to ``/abort_requests``. An aborted request returns its tokens so far, finish
  reason ``abort``, as SGLang's do.
- Pause: ``/pause?mode=abort`` aborts what is running and holds what arrives until ``/resume``
  (SGLang's ``abort``); ``in_place`` and ``retract`` map to vLLM's ``keep``.
- Weights from disk: ``/collective_rpc reload_weights`` then ``/update_weight_version``, with the
  engine paused (``mode=wait``) unless it already is. vLLM's in-place reload stops the engine on a
  tensor it cannot load, so the folder is first checked against the checkpoint the engine serves
  (``checkpoint.check_compatible``): a bad folder is refused and nothing changes, as with SGLang.
- Weights from a distributed group (``--weight-transport distributed``): vLLM's weight-transfer
  endpoints (``/init_weight_transfer_engine``, then per version ``/start_weight_update``, one
  ``/update_weights`` per bucket, ``/finish_weight_update`` with the version) with the backend ``slime_mt``
  (``engine/weights/vllm_worker.py``), which joins the same torch process group as SGLang's weight-group
  endpoints and receives the same broadcasts, so the trainer's side is one for every engine. vLLM's
  own NCCL and IPC backends would need vLLM in the trainer's process and a GPU. Each bucket is checked
  against the served checkpoint before any engine is asked to receive it.
- Several engines: no router process; the client sends each request to an engine of its rotation
  itself and keeps the requests of one ``route`` (a trajectory) on the engine its first request went
  to, the least loaded one then, so its turns reuse that engine's prefix cache. On Ray the
  supervisor takes a lost engine out of the rotation (``leave``): the request it was serving is sent
  again, from its start, to another engine; the engine started again enters it (``enter``) once it
  has the current weights.
- LoRA (a run whose updates send the adapter, ``config.training.adapter_updates``): servers started with
  ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; each update loads the adapter's PEFT folder in
  place under its name (``replace_lora_adapter``), and every request names it in ``model`` (``lora_path``,
  the client's or the request's), which vLLM's generate endpoint resolves to the adapter.
- Not yet: colocated engines (vLLM's ``/sleep`` and ``/wake_up`` are the endpoints they would use; its
  sleep mode needs CUDA, a no-op on CPUs, so nothing here could check it: ``--colocate`` is refused)
  and weights by tensor handle (vLLM's IPC backend is CUDA's).
- Images: refused (``IMAGES_REFUSED``). vLLM's generate endpoint takes images beside token ids
  (``content_parts``) and expands the pads itself, which is SGLang's contract, but that path is not
  yet checked against the ids the trainer builds: vLLM's CPU attention refuses the tiny VLMs' head
  size and the CPU build's torchvision does not load, so nothing here can run it. A VLM run with
  ``--engine vllm`` fails at its first request with this message rather than train on ids unchecked.

The server's RL endpoints exist only with ``VLLM_SERVER_DEV_MODE=1`` (``engine/launch.py`` sets it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from slime_mt.engine.clients.priority import vllm_priority
from slime_mt.engine.clients.sglang import JOIN_SECONDS, EngineClient, weight_group_joins
from slime_mt.engine.weights.checkpoint import check_compatible, check_tensor, tensor_headers
from slime_mt.engine.weights.group import dtype_of
from slime_mt.errors import EngineError, EngineRequestError, WeightUpdateError
from slime_mt.timeline import default_lane

logger = logging.getLogger(__name__)

GENERATE = "/inference/v1/generate"
REQUEST_PREFIX = "generate-tokens-"  # how vLLM's generate endpoint names a request_id internally
WORKER_EXTENSION = "slime_mt.engine.weights.vllm_worker.WeightGroupWorker"  # brings the weight-group backend
WEIGHT_BACKEND = "slime_mt"  # vllm_worker.BACKEND, named here without importing vLLM
REPACK_CALL = "slime_mt_repack_cpu_kernels"  # vllm_worker.WeightGroupWorker's call
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default; vLLM's is 16
ROUTES_KEPT = 100_000  # trajectories whose engine the client remembers (least recently used dropped)

# SGLang's sampling parameter -> vLLM's
RENAMED = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
    "no_stop_trim": "include_stop_str_in_output",
}
SAME = {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "logit_bias",
}
REFUSED = {
    "json_schema": "structured output through this client",
    "regex": "structured output through this client",
    "ebnf": "structured output through this client",
    "structural_tag": "structured output through this client",
    "stop_regex": "stop regexes",
    "custom_params": "SGLang's custom logit processors",
}
IMAGES_REFUSED = (
    "--engine vllm serves text models for now; its image path (content_parts beside token ids) is "
    "not yet checked to keep the ids exact, so VLMs run on --engine sglang or local"
)
PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "keep"}


def vllm_sampling(params: dict, return_logprob: bool) -> dict:
    """SGLang's ``sampling_params`` -> vLLM's; EngineRequestError naming a parameter vLLM cannot honour."""
    out: dict[str, Any] = {"max_tokens": SGLANG_DEFAULT_MAX_NEW_TOKENS, "detokenize": True}
    for key, value in params.items():
        if key in RENAMED:
            out[RENAMED[key]] = value
        elif key in SAME:
            out[key] = value
        elif key == "n":
            if value != 1:
                raise _refused(f"sampling_params.n={value}: send one request per sample (n must be 1)")
        elif key in REFUSED:
            raise _refused(f"sampling_params.{key}: --engine vllm does not support {REFUSED[key]}")
        else:
            raise _refused(f"sampling_params.{key} is not a sampling parameter --engine vllm can honour")
    if return_logprob:
        out["logprobs"] = 0  # the sampled token's log-prob only
    return out


def _refused(message: str) -> EngineRequestError:
    return EngineRequestError("--engine vllm", 400, message)


def sglang_response(answer: dict, rid: str) -> dict:
    """A vLLM generate answer (one choice, ``output_mode: text``) -> SGLang's ``/generate`` response."""
    choice = answer["choices"][0]
    ids = list(choice.get("token_ids") or [])
    reason = choice.get("finish_reason")
    if reason == "stop":
        matched = choice.get("stop_reason")
        finish: dict[str, Any] = {"type": "stop", "matched": ids[-1] if matched is None and ids else matched}
    elif reason == "length":
        finish = {"type": "length", "length": len(ids)}
    else:
        finish = {"type": "abort", "message": f"vLLM finish_reason {reason!r}"}
    usage = answer.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    spans = choice.get("weight_versions") or []
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": len(ids),
        "cached_tokens": details.get("cached_tokens") or 0,
        "weight_version": spans[-1]["version"] if spans else None,
    }
    if len(spans) > 1:
        meta["weight_version_spans"] = spans
    content = (choice.get("logprobs") or {}).get("content")
    if content is not None:
        if len(content) != len(ids):
            raise EngineError(f"vLLM returned {len(ids)} tokens but {len(content)} log-probs for request {rid}")
        meta["output_token_logprobs"] = [[float(c["logprob"]), t, None] for c, t in zip(content, ids)]
    return {"text": choice.get("text", ""), "output_ids": ids, "meta_info": meta}


class VLLMClient(EngineClient):
    """``EngineClient`` for vLLM servers (see the module docstring); ``worker_urls`` are the engines."""

    def __init__(self, url: str, worker_urls: list[str] | None = None, **kw: Any):
        super().__init__(url, worker_urls, **kw)
        self._routes: OrderedDict[str, str] = OrderedDict()
        self.rotation = list(self.worker_urls)  # the engines new requests go to (--ray: the supervisor's)
        self._load: Counter[str] = Counter()  # requests in flight per engine
        self._served: dict[str, tuple[tuple[int, ...], str]] | None = None
        self._updating: list[str] | None = None  # a distributed update begun: the engines it paused
        self._warned_repack = False

    # ------------------------------------------------------------------ generation

    def _engine_for(self, route: str | None) -> str:
        """The engine of ``route`` (the least loaded one in the rotation for a new route, for none, or
        for a route whose engine has left the rotation)."""
        if not self.rotation:
            raise EngineError(f"no engine in the rotation (engines {self.worker_urls} were lost)")
        if len(self.rotation) == 1:
            return self.rotation[0]
        if route is not None and self._routes.get(route) in self.rotation:
            self._routes.move_to_end(route)
            return self._routes[route]
        url = min(self.rotation, key=self._load.__getitem__)
        if route is not None:
            self._routes[route] = url
            if len(self._routes) > ROUTES_KEPT:
                self._routes.popitem(last=False)
        return url

    def leave(self, url: str) -> None:
        """``url``'s engine was lost (``--ray``: the supervisor saw it die): no request goes there, and
        a request it was serving is generated again on another engine."""
        if url in self.rotation:
            self.rotation.remove(url)

    def enter(self, url: str) -> None:
        """``url``'s engine (started again) has the current weights: new requests may go to it."""
        if url not in self.rotation:
            self.rotation.append(url)

    async def generate(
        self,
        input_ids: list[int] | None = None,
        sampling_params: dict | None = None,
        image_data: list[str] | None = None,
        text: str | None = None,
        return_logprob: bool = True,
        rid: str | None = None,
        timeout: float | None = None,
        route: str | None = None,
        **extra: Any,
    ) -> dict:
        """One prompt (token ids, or text tokenized by the engine) -> SGLang's response dict."""
        rid = rid or uuid.uuid4().hex
        if image_data:
            raise _refused(f"image_data: {IMAGES_REFUSED}")
        adapter = extra.pop("lora_path", None) or self.lora_path  # vLLM names the adapter in ``model``
        if extra:
            raise _refused(f"request field(s) {sorted(extra)} are not supported with --engine vllm")
        if input_ids is None and text is None:
            raise _refused("a request needs input_ids or text")
        while True:
            url = self._engine_for(route)
            self._load[url] += 1
            try:
                with default_lane(f"route {route}" if route else None):
                    return await self._generate_on(
                        url, input_ids, text, sampling_params, return_logprob, rid, timeout, adapter
                    )
            except EngineError:
                if url in self.rotation:
                    raise
                logger.warning("engine %s was lost while it served %s: the request goes to another engine", url, rid)
            finally:
                self._load[url] -= 1

    async def _generate_on(
        self,
        url: str,
        input_ids: list[int] | None,
        text: str | None,
        sampling_params: dict | None,
        return_logprob: bool,
        rid: str,
        timeout: float | None,
        adapter: str | None = None,
    ) -> dict:
        tokenized = await self._tokenize(url, text) if input_ids is None else None
        body: dict[str, Any] = {
            "request_id": rid,
            "token_ids": list(input_ids if input_ids is not None else tokenized),
            "sampling_params": vllm_sampling(sampling_params or {}, return_logprob),
            "output_mode": "text",
        }
        if adapter is not None:
            body["model"] = adapter
        priority = vllm_priority()
        if priority is not None:
            body["priority"] = priority

        def convert(answer: dict) -> dict:
            response = sglang_response(answer, rid)
            if tokenized is not None:
                response["meta_info"]["prompt_token_ids"] = tokenized
            return response

        return await self._generate(url + GENERATE, body, [rid], timeout, convert, engine=url)

    async def generate_batch(
        self,
        input_ids: list[list[int]],
        sampling_params: dict | None = None,
        return_logprob: bool = True,
        timeout: float | None = None,
        **extra: Any,
    ) -> list[dict]:
        """Several prompts as concurrent requests ``{rid}_{i}`` (vLLM's endpoint takes one prompt)."""
        rid = extra.pop("rid", None) or uuid.uuid4().hex
        images = extra.pop("image_data", None)  # refused by generate, as for one prompt
        return list(
            await asyncio.gather(
                *(
                    self.generate(ids, sampling_params, images, None, return_logprob, f"{rid}_{i}", timeout, **extra)
                    for i, ids in enumerate(input_ids)
                )
            )
        )

    async def _tokenize(self, url: str, text: str) -> list[int]:
        answer = await self._post(url, "/tokenize", {"prompt": text, "add_special_tokens": False})
        return list(answer["tokens"])

    async def _post(self, url: str, path: str, body: dict | None = None) -> Any:
        return (await self._broadcast(path, body, urls=[url]))[0]

    # ------------------------------------------------------------------ control endpoints

    def _abort_call(self, rid: str | None, abort_all: bool) -> tuple[str, dict]:
        """vLLM's ``/abort_requests``: the request's internal name, or no name (every request)."""
        return "/abort_requests", {} if abort_all or rid is None else {"request_ids": [REQUEST_PREFIX + rid]}

    async def pause(self, mode: str = "in_place", timeout: float | None = None) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: choose from {sorted(PAUSE_MODES)}")
        await self._broadcast(f"/pause?mode={PAUSE_MODES[mode]}", timeout=timeout)

    async def resume(self, timeout: float | None = None) -> None:
        await self._broadcast("/resume", timeout=timeout)

    async def paused(self) -> list[bool]:
        return [bool((await self._get(u, "/is_paused"))["is_paused"]) for u in self.worker_urls]

    async def flush_cache(self, timeout: float | None = None) -> None:
        await self._broadcast("/reset_prefix_cache", timeout=timeout, text=True)

    async def weight_versions(self) -> list[str]:
        return [str((await self._get(u, "/weight_info"))["weight_version"]) for u in self.worker_urls]

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, timeout: float | None = None
    ) -> list[dict]:
        """Every engine reloads ``model_path`` in place (checked first: a folder that does not fit the
        served checkpoint is refused with nothing changed) and, when given, takes ``weight_version``;
        -> SGLang's answers (``success``, ``message``, ``weight_version``) once every engine has."""
        try:
            count = check_compatible(model_path, await self._served_headers())
        except WeightUpdateError as e:
            raise EngineRequestError(self.worker_urls[0] + "/update_weights_from_disk", 400, str(e)) from None
        async with self._paused():  # no request generates while the weights change
            await self._broadcast(
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": str(model_path)}},
                timeout=timeout or 600.0,
                retry=False,
            )
            await self._repack_cpu_kernels()
            await self._broadcast("/reset_prefix_cache", timeout=timeout, text=True)  # no KV of the old weights
            if weight_version is not None:
                await self._broadcast("/update_weight_version", {"new_version": str(weight_version)}, timeout=timeout)
        versions = await self.weight_versions()
        return [
            {"success": True, "message": f"reloaded {count} tensors from {model_path}", "weight_version": v}
            for v in versions
        ]

    async def replace_lora_adapter(
        self, name: str, path: str, weight_version: str | None = None, timeout: float | None = None
    ) -> None:
        """Every engine serves the PEFT folder ``path`` as LoRA adapter ``name`` (vLLM's
        ``/v1/load_lora_adapter`` with ``load_inplace``: a name already loaded keeps its slot and takes the new
        weights), with the engines paused as for a reload, its prefix cache reset (vLLM keys cached blocks by
        the adapter's name and path, so a folder loaded again under one path would reuse blocks of the old
        weights) and, when given, ``weight_version``. EngineRequestError naming an engine that refused."""
        body = {"lora_name": name, "lora_path": str(path), "load_inplace": True}
        async with self._paused():
            await self._broadcast("/v1/load_lora_adapter", body, timeout=timeout, text=True)  # in place: idempotent
            await self._broadcast("/reset_prefix_cache", timeout=timeout, text=True)
            if weight_version is not None:
                await self._broadcast("/update_weight_version", {"new_version": str(weight_version)}, timeout=timeout)

    async def _pause(self) -> list[str]:
        """Pause (``mode=wait``: what runs finishes first) the engines not paused already (an update
        gate pauses them) -> those, for ``_resume``."""
        was_paused = await self.paused()
        waiting = [u for u, p in zip(self.worker_urls, was_paused) if not p]
        for url in waiting:
            await self._post(url, "/pause?mode=wait")
        return waiting

    async def _resume(self, urls: list[str]) -> None:
        for url in urls:
            await self._post(url, "/resume")

    @contextlib.asynccontextmanager
    async def _paused(self) -> AsyncIterator[None]:
        waiting = await self._pause()
        try:
            yield
        finally:
            await self._resume(waiting)

    async def _repack_cpu_kernels(self) -> None:
        """After ``reload_weights``: a CPU build's LM head tied to the embedding is packed again from
        the new weights (``vllm_worker.repack_cpu_kernels``; nothing on GPUs). A server without
        slime_mt's worker extension cannot: warned once, as its tied LM head then keeps the old weights."""
        try:
            await self._broadcast("/collective_rpc", {"method": REPACK_CALL}, retry=False)
        except EngineError as e:
            if not self._warned_repack:
                self._warned_repack = True
                logger.warning(
                    "%s failed (%s): a server started without --worker-extension-cls %s keeps, on CPUs, an LM head "
                    "tied to the embedding at the old weights after a reload",
                    REPACK_CALL,
                    e,
                    WORKER_EXTENSION,
                )

    async def _served_headers(self) -> dict[str, tuple[tuple[int, ...], str]]:
        if self._served is None:
            self._served = tensor_headers((await self.model_info())["model_path"])
        return self._served

    async def init_weights_update_group(
        self, master_address: str, master_port: int, tp_sizes: list[int], group_name: str, backend: str
    ) -> None:
        """Every engine joins the weight group whose rank 0 is the caller, through vLLM's
        ``/init_weight_transfer_engine`` and the ``slime_mt`` backend (``engine/weights/vllm_worker.py``); returns
        once every engine has joined, so the caller joins as rank 0 while this waits."""
        bodies = [
            {"init_info": b} for b in weight_group_joins(master_address, master_port, tp_sizes, group_name, backend)
        ]
        try:
            await self._broadcast("/init_weight_transfer_engine", bodies, timeout=JOIN_SECONDS, retry=False)
        except EngineError as e:
            raise EngineError(
                f"{e} (a vLLM server joins the weight group when started with --worker-extension-cls "
                f'{WORKER_EXTENSION} --weight-transfer-config \'{{"backend": "{WEIGHT_BACKEND}"}}\', as '
                "slime-mt starts them)"
            ) from None

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, weight_version: str
    ) -> None:
        """Every engine receives one bucket that the caller broadcasts as rank 0 (in this order); the
        version's first bucket pauses the engines (unless paused) and starts vLLM's update, and
        ``finish_weights_update`` ends it. The bucket is checked first against the served checkpoint
        (vLLM stops on a tensor it cannot load): one that does not fit is an EngineRequestError naming
        the tensor, no engine is asked to receive it, and the caller's broadcast is left unanswered."""
        served = await self._served_headers()
        try:
            for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
                floating = dtype_of(dtype).is_floating_point
                check_tensor(f"weights version {weight_version}", name, shape, floating, served)
        except (WeightUpdateError, ValueError) as e:
            raise EngineRequestError(self.worker_urls[0] + "/update_weights", 400, str(e)) from None
        if self._updating is None:
            self._updating = await self._pause()
            try:
                await self._broadcast("/start_weight_update", retry=False)
            except BaseException:
                await self._resume(self._updating)
                self._updating = None
                raise
        bucket = {"names": names, "dtype_names": dtypes, "shapes": shapes}
        await self._broadcast("/update_weights", {"update_info": bucket}, retry=False)

    async def finish_weights_update(self, weight_version: str | None) -> None:
        """End the update the buckets began: vLLM processes what arrived and takes ``weight_version``,
        the prefix cache is reset, the engines paused for it continue. After a failed bucket
        (``weight_version`` None) the version stays the last one; the layers that received their
        tensors have them (the caller stops the run: its weights are mixed)."""
        if self._updating is None:
            return
        waiting, self._updating = self._updating, None
        try:
            body = {} if weight_version is None else {"weight_version": str(weight_version)}
            await self._broadcast("/finish_weight_update", body, retry=False)
            await self.flush_cache()  # no KV of the old weights
        finally:
            await self._resume(waiting)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._broadcast("/shutdown_weight_transfer_engine", timeout=60.0, retry=False)

    async def update_weights_from_tensor(self, *args: Any, **kw: Any) -> None:
        raise _unsupported("weights by tensor handle")

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        raise _unsupported("colocated engines (--colocate)")

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        raise _unsupported("colocated engines (--colocate)")

    async def health_generate(self) -> bool:
        """Every engine generates one token."""

        async def one(url: str) -> bool:
            try:
                body = {"token_ids": [0], "sampling_params": {"max_tokens": 1}}
                await self._post(url, GENERATE, body)
                return True
            except EngineError:
                return False

        return all(await asyncio.gather(*(one(u) for u in self.worker_urls)))

    async def model_info(self) -> dict:
        """SGLang's ``/model_info`` fields from vLLM's ``/v1/models``: ``model_path`` is the served folder."""
        models = (await self._get(self.worker_urls[0], "/v1/models"))["data"]
        return {"model_path": models[0].get("root") or models[0]["id"], "is_generation": True}

    async def server_info(self) -> list[dict]:
        """vLLM's ``/server_info`` of every engine, with SGLang's ``tp_size``: the devices that join a
        weight group (vLLM's world size, data-parallel replicas included)."""
        infos = []
        for url in self.worker_urls:
            info = await self._get(url, "/server_info?config_format=json")
            info["tp_size"] = int((await self._get(url, "/get_world_size?include_dp=true"))["world_size"])
            infos.append(info)
        return infos


def _unsupported(what: str) -> EngineError:
    return EngineError(f"--engine vllm: {what} is not supported yet; see slime_mt/engine/clients/vllm.py")
