"""Plug-ins written against slime's API, run with ``--slime-compat``.

``install()`` makes ``import slime...`` resolve to the modules under ``slime_mt/compat/slime/``, which
map slime's names onto this project's (one module object per name, so ``slime.utils.types.Sample`` is
``slime_mt.compat.slime.utils.types.Sample``). ``SlimeCompat`` is the run's side of it, created once
the engines run (``SlimeCompat.activate(ctx)``):

- the data: samples are slime's ``Sample`` (a subclass of ``slime_mt.types.Sample`` with
  ``Sample.Status``, ``append_response_tokens`` and slime's extra fields); with
  ``--apply-chat-template`` every prompt is rendered to text at load time, tools included, as slime's
  dataset does, and a generate function gets the sample as slime hands it over (no tokens yet);
- the engine: ``post(url, payload)`` to the run's engine (``args.sglang_router_ip/port``) goes through
  the run's client (retries, the weight-update gate), expanded image pads collapsed to one per image
  as the engine expects, and, as the framework's own turn loop does, a ``sampling_seed`` per (run
  seed, step, sample, request) unless the payload has one, so a run samples the same again; every
  other URL is a plain HTTP POST;
- text sent instead of token ids: the engine re-tokenizes it, so the ids a sample trains may differ
  from the ids the model saw. The first such request of a run logs a warning; each sample's drift
  (tokens outside the matching blocks of the engine's view of each context and the trained context
  before that turn's output, the larger side; the engine's view is the text tokenized as the engine
  does) is ``metadata["text_drift_tokens"]``, reported as
  ``rollout/text_drift_tokens`` and ``rollout/text_drift_samples``;
- after the generate function (and on every sample a ``--rollout-function-path`` returns), ``adopt``
  reads the sample as slime does: a missing loss mask trains every response token, missing rollout
  log-probs are None (not sampled: the trainer's own stand in), ``remove_sample`` masks every token,
  and a sample with response tokens but no ``Turn`` records gets them rebuilt from its loss-mask runs
  (each run of 1s is one turn whose context is everything before it), so the turn metrics and
  step-wise training work.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import importlib.abc
import importlib.util
import logging
import sys
from typing import Any
from urllib.parse import urlsplit

import torch

from slime_mt.compat.run_state import clear_active, set_active
from slime_mt.compat.slime.utils.types import Sample as SlimeSample
from slime_mt.engine.protocol import collapse_image_pads
from slime_mt.processing import QwenVLProcessor
from slime_mt.rollout.multi_turn import route_of, turn_seed
from slime_mt.rollout.retokenize import common_ends, drift
from slime_mt.tokenization import mask_runs
from slime_mt.types import Sample, Status, Turn

logger = logging.getLogger(__name__)

SHIM_PACKAGE = "slime_mt.compat.slime"
# slime's argument names this project has no flag for, with slime's defaults (a custom YAML key wins)
SLIME_ARG_DEFAULTS: dict[str, Any] = {
    "ci_test": False,
    "group_rm": False,
    "use_rollout_routing_replay": False,
    "rollout_skip_special_tokens": False,
    "sglang_dp_size": None,
    "sglang_enable_deterministic_inference": False,
    "apply_chat_template_kwargs": {},
    "rollout_sample_filter_path": None,
    "sglang_model_routers": None,
    "router_policy": None,
}

# (the sample a generate call is for, its requests so far), set around each generate call
_CALL: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("slime_mt_compat_call", default=None)


class _SlimeAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``slime`` and ``slime.*`` -> the same module objects as ``slime_mt.compat.slime`` and below; and
    ``qwen_vl_utils``, which slime's VLM examples import, -> ``slime_mt.compat.qwen_vl_utils`` when the
    published package or the torchvision it imports is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "qwen_vl_utils" and not _published_qwen_vl_utils():
            return importlib.util.spec_from_loader(name, self, origin="slime_mt.compat.qwen_vl_utils")
        if name != "slime" and not name.startswith("slime."):
            return None
        real = SHIM_PACKAGE + name[len("slime") :]
        if importlib.util.find_spec(real) is None:
            return None
        return importlib.util.spec_from_loader(name, self, origin=real)

    def create_module(self, spec):
        return importlib.import_module(spec.origin)

    def exec_module(self, module):
        pass  # the real module ran when it was imported under its own name


def _published_qwen_vl_utils() -> bool:
    """Whether the published ``qwen_vl_utils`` and the torchvision it imports are both installed."""
    finders = [f for f in sys.meta_path if not isinstance(f, _SlimeAlias)]
    return all(
        any(f.find_spec(name, None) is not None for f in finders if hasattr(f, "find_spec"))
        for name in ("qwen_vl_utils", "torchvision")
    )


def install() -> None:
    """Make ``import slime...`` resolve to the compatibility modules (idempotent). A real slime
    package on the path is shadowed, with a warning."""
    if any(isinstance(finder, _SlimeAlias) for finder in sys.meta_path):
        return
    real = importlib.util.find_spec("slime") if "slime" not in sys.modules else None
    if real is not None and real.origin:
        logger.warning("--slime-compat: 'import slime' resolves to slime_mt.compat, not to %s", real.origin)
    sys.meta_path.insert(0, _SlimeAlias())


class SlimeCompat:
    """One per run, on rank 0: the context, slime's per-run state, the text requests per sample."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.state = None  # slime.rollout.sglang_rollout.GenerateState, built on first use
        processor = ctx.processor
        self.image_token_id = processor.image_token_id if isinstance(processor, QwenVLProcessor) else None
        self.engine_urls = {_generate_url(u) for u in [ctx.client.url, *(ctx.client.worker_urls or [])]}
        self._warned_text = False
        self._records: dict[int, list] = {}  # id(sample) -> [(text requests' engine-view ids or None, outputs)]

    @classmethod
    def activate(cls, ctx) -> SlimeCompat:
        """Install the aliases, bind ``ctx`` (``ctx.compat``) and give ``ctx.args`` slime's names."""
        install()
        compat = cls(ctx)
        ctx.compat = compat
        args = ctx.args
        for key, value in SLIME_ARG_DEFAULTS.items():
            if not hasattr(args, key):
                setattr(args, key, value.copy() if isinstance(value, dict) else value)
        where = urlsplit(ctx.client.url)
        args.sglang_router_ip, args.sglang_router_port = where.hostname, where.port
        set_active(compat)
        return compat

    def close(self) -> None:
        clear_active(self)

    # ------------------------------------------------------------------ data

    def adopt_dataset(self, dataset, apply_chat_template: bool) -> None:
        """slime's samples; with ``apply_chat_template`` every prompt rendered to text (slime's
        dataset: a string prompt becomes one user message; the row's tools go to the template)."""
        dataset.sample_class = SlimeSample
        if not apply_chat_template:
            return
        for row in dataset.rows:
            is_chat = isinstance(row.prompt, list) and all("role" in m for m in row.prompt)
            messages = row.prompt if is_chat else [{"role": "user", "content": row.prompt}]
            row.prompt = self.ctx.encoder(row.metadata.get("tools")).render(messages, add_generation_prompt=True)
        # the render is done: the framework's own generate functions tokenize these prompts as they are
        self.ctx.data = dataclasses.replace(self.ctx.data, apply_chat_template=False)

    # ------------------------------------------------------------------ the engine

    def is_engine(self, url: str) -> bool:
        return _generate_url(url, already=True) in self.engine_urls

    async def engine_generate(self, payload: dict) -> dict:
        """A slime ``/generate`` payload through the run's client (its gate and retries)."""
        body = dict(payload)
        sampling = body.pop("sampling_params", None) or {}
        ids = body.pop("input_ids", None)
        text = body.pop("text", None)
        images = body.pop("image_data", None)
        return_logprob = bool(body.pop("return_logprob", False))
        if ids is not None:
            ids = [int(t) for t in (ids.tolist() if hasattr(ids, "tolist") else ids)]
            if images and self.image_token_id is not None:
                ids = collapse_image_pads(ids, self.image_token_id)[0]
        if text is not None:
            self._warn_text()
        call = _CALL.get()
        if call is not None and "sampling_seed" not in sampling and "rollout_id" in call[0].metadata:
            sample, records = call
            seed = turn_seed(self.ctx.data.rollout_seed, sample.metadata["rollout_id"], sample.index or 0, len(records))
            sampling = {**sampling, "sampling_seed": seed}
        route = route_of(call[0]) if call is not None else None
        response = await self.ctx.client.generate(
            ids, sampling, images, text, return_logprob, rid=body.pop("rid", None), route=route, **body
        )
        if call is not None:  # every request counts (the seed's index); text ones carry what the engine saw
            call[1].append((self._engine_view(text, response) if text is not None else None, _generated(response)))
        return response

    def _engine_view(self, text: str, response: dict) -> list[int]:
        """The ids the engine read a text prompt as: its ``prompt_token_ids`` when the plug-in asked for
        them, else the text tokenized as the engine does (the run's tokenizer, no special tokens added;
        nothing is added to the payload, which an older SGLang would refuse)."""
        seen = response.get("meta_info", {}).get("prompt_token_ids")
        return list(seen) if seen is not None else self.ctx.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _warn_text(self) -> None:
        if self._warned_text:
            return
        self._warned_text = True
        logger.warning(
            "a plug-in sent text to the engine (POST /generate with 'text') instead of token ids: the engine "
            "re-tokenizes it, so the ids trained may differ from the ids the model saw; "
            "rollout/text_drift_tokens counts the difference (send 'input_ids': sample.tokens to make it exact)"
        )

    @contextlib.contextmanager
    def generating(self, sample: Sample):
        """Around one generate call: the text requests it sends are recorded for ``sample``."""
        records: list = []
        token = _CALL.set((sample, records))
        try:
            yield
        finally:
            _CALL.reset(token)
            if any(seen is not None for seen, _ in records):
                self._records[id(sample)] = records

    # ------------------------------------------------------------------ samples

    def adopt(self, sample: Sample) -> None:
        """Read a sample a slime plug-in built as slime does (see the module docstring); idempotent."""
        n = sample.response_length
        if sample.loss_mask is None or (n and not sample.loss_mask):
            sample.loss_mask = [1] * n
        if getattr(sample, "remove_sample", False):
            sample.loss_mask = [0] * n
        if sample.rollout_log_probs is not None and n and not sample.rollout_log_probs:
            sample.rollout_log_probs = None
        if sample.token_versions and len(sample.token_versions) != n:
            sample.token_versions = None
        if sample.multimodal_train_inputs:  # the tensors the trainer reads (a processor's lists dropped)
            tensors = {k: v for k, v in sample.multimodal_train_inputs.items() if isinstance(v, torch.Tensor)}
            sample.multimodal_train_inputs = tensors or None
        if n and not sample.turns and sample.tokens and len(sample.loss_mask) == n:
            rebuild_turns(sample, self.image_token_id)
        if sample.status == Status.TRUNCATED and sample.turns and sample.turns[-1].finish_reason == "length":
            sample.metadata.setdefault("termination", "engine_length")
        records = self._records.pop(id(sample), None)
        if records:
            sample.metadata["text_drift_tokens"] = text_drift(sample, records, self.image_token_id)

    def adopt_groups(self, groups: list[list[Sample]]) -> None:
        for group in groups:
            for sample in group:
                self.adopt(sample)


def _generated(response: dict) -> int:
    """Tokens a ``/generate`` answer generated (its ids, its log-prob entries, or SGLang's count)."""
    meta = response.get("meta_info", {})
    for ids in (response.get("output_ids"), meta.get("output_token_logprobs")):
        if ids is not None:
            return len(ids)
    return int(meta.get("completion_tokens") or 0)


def _generate_url(url: str, already: bool = False) -> str:
    url = url.rstrip("/")
    if not already:
        url += "/generate"
    where = urlsplit(url)
    host = "127.0.0.1" if where.hostname in ("localhost", "0.0.0.0") else where.hostname
    return f"{where.scheme}://{host}:{where.port}{where.path}"


def rebuild_turns(sample: Sample, image_token_id: int | None = None) -> None:
    """``Turn`` records from the loss-mask runs of a sample that has none: each run of 1s is one turn's
    output, the 0s after it its observation, its context everything before it (and the images whose
    pads lie there). The last turn's finish reason follows the status; the weight versions are the
    sample's when there is one per turn."""
    start = sample.prompt_length
    runs = mask_runs(sample.loss_mask)
    versions = sample.weight_versions if len(sample.weight_versions) == len(runs) else [None] * len(runs)
    last = {Status.TRUNCATED: "length", Status.ABORTED: "abort"}.get(sample.status, "stop")
    for k, (a, b) in enumerate(runs):
        end = start + (runs[k + 1][0] if k + 1 < len(runs) else sample.response_length)
        images = 0
        if image_token_id is not None:
            images = len(collapse_image_pads(sample.tokens[: start + a], image_token_id)[1])
        sample.turns.append(
            Turn(
                output_start=start + a,
                output_end=start + b,
                observation_end=end,
                finish_reason=last if k == len(runs) - 1 else "stop",
                weight_version=versions[k],
                num_images=images,
            )
        )
    sample.metadata["turns_rebuilt"] = len(runs)


def text_drift(sample: Sample, records: list, image_token_id: int | None = None) -> int:
    """Over a sample's requests ``(engine-view prompt ids of a text request or None, tokens generated)``
    (in order, those that generated tokens, paired with its turns in order): tokens that differ
    between the engine's view of a text request's context and the trained context before that turn's
    output."""
    turns = [t for t in sample.turns if t.output_tokens]
    requests = [seen for seen, generated in records if generated]
    total = 0
    for seen, turn in zip(requests, turns):
        if seen is not None:  # a text request (token ids were sent as they were trained)
            trained = turn.context_ids if turn.context_ids is not None else sample.tokens[: turn.output_start]
            total += context_drift(seen, trained, image_token_id)
    for seen in requests[len(turns) :]:  # text requests whose output the sample does not hold
        total += len(seen or [])
    return total


def context_drift(seen: list[int], trained: list[int], image_token_id: int | None = None) -> int:
    """``retokenize.drift`` of two contexts, image pads collapsed, past their common prefix and suffix."""
    if image_token_id is not None:
        seen = collapse_image_pads(seen, image_token_id)[0]
        trained = collapse_image_pads(trained, image_token_id)[0]
    head, tail = common_ends(seen, trained)
    return drift(seen[head : len(seen) - tail], trained[head : len(trained) - tail])
