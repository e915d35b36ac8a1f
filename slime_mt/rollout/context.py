"""``RolloutContext``: what every rollout needs, created once per run and passed explicitly.

slime's plug-in signatures take only ``args``; the trainer puts the context on
``args.rollout_context`` so user rollout and generate functions reach the engine client, the
tokenizer/processor and the observation encoder without globals.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import inspect
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slime_mt.config import Config, DataConfig, GatewayConfig, RolloutConfig, priority_scheduling
from slime_mt.config.rollout import rewrites_history
from slime_mt.config.training import POLICY_ADAPTER, adapter_updates
from slime_mt.engine.clients import client_for
from slime_mt.engine.clients.sglang import EngineClient, output_of
from slime_mt.errors import ConfigError, EngineError, PluginError
from slime_mt.plugins import load_module
from slime_mt.processing import load_tokenizer_or_processor, tokenizer_of, use_chat_template
from slime_mt.rollout.context_policy import ContextPolicy, load_policy
from slime_mt.rollout.env_workers import EnvWorkerPool
from slime_mt.rollout.template_check import path_of, warn_if_inexact
from slime_mt.routes import RouteLayout
from slime_mt.timeline import Timeline
from slime_mt.tokenization import Encoded, ObservationEncoder
from slime_mt.types import parse_version


@dataclass
class RolloutContext:
    client: EngineClient
    processor: Any
    rollout: RolloutConfig
    data: DataConfig
    args: argparse.Namespace
    env_executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(64, "slime-mt-env"))
    _encoders: dict[str, ObservationEncoder] = field(default_factory=dict)
    _env_module: Any = None
    _policy: Any = None
    compat: Any = None  # slime_mt.compat.SlimeCompat under --slime-compat
    _loop: asyncio.AbstractEventLoop | None = None
    _prompt_encodings: dict[int, Encoded] = field(default_factory=dict)  # id(sample) -> its encoded prompt
    start_version: int = 0  # the weights the run started from (resumed runs: the checkpoint's step)
    env_workers: Any = None  # rollout.env_workers.EnvWorkerPool under --env-num-workers
    rollout_workers: Any = None  # rollout.rollout_workers.RolloutWorkerPool under --rollout-num-processes
    gateway_config: GatewayConfig = field(default_factory=GatewayConfig)
    gateway: Any = None  # this process's agent gateway, started by the first agent (``gateway.server.open_gateway``)
    gateway_lock: asyncio.Lock | None = None  # made on the loop by the first open_gateway
    judge: Any = None  # envs.llm_judge.Judge, built by the first judge call (``judge_of``)
    timeline: Timeline | None = None  # this process's spans for RUN_DIR/trace.json (None: --trace off)
    route_layout: RouteLayout | None = None  # --use-rollout-routing-replay: the model's routes (routes.py)
    priority_scheduling: bool = False  # the engines serve requests by priority (config.priority_scheduling)

    @classmethod
    def create(
        cls,
        cfg: Config,
        model_path: str,
        url: str,
        worker_urls: list[str] | None = None,
        process: str = "rollout side",
    ) -> RolloutContext:
        """The context of one rollout process (``process`` names it in the run's trace)."""
        e = cfg.engine
        client = client_for(
            e.engine,
            url,
            worker_urls,
            timeout=e.engine_request_timeout,
            max_retries=e.engine_max_retries,
            max_connections=e.sglang_server_concurrency * len(worker_urls or [url]),
        )
        processor = load_tokenizer_or_processor(model_path)
        if cfg.data.chat_template:
            use_chat_template(processor, cfg.data.chat_template)
        if e.engine == "vllm" and getattr(processor, "image_token_id", None) is not None:
            from slime_mt.engine.clients.vllm import IMAGES_REFUSED

            raise ConfigError(f"--engine vllm with the VLM {model_path}: {IMAGES_REFUSED}")
        if adapter_updates(cfg):  # the engines serve the run's adapter by name: every request names it
            client.lora_path = POLICY_ADAPTER
        ctx = cls(client, processor, cfg.rollout, cfg.data, cfg.to_args(), gateway_config=cfg.gateway)
        ctx.args.rollout_context = ctx
        ctx.priority_scheduling = priority_scheduling(cfg)
        if cfg.train.use_rollout_routing_replay:
            ctx.route_layout = RouteLayout.of(json.loads((Path(model_path) / "config.json").read_text()))
        if cfg.debug.trace != "off":
            ctx.timeline = client.timeline = Timeline(process, trajectories=cfg.debug.trace == "all")
        r = cfg.rollout
        if r.env_num_workers:
            ctx.env_workers = EnvWorkerPool(
                r.env_num_workers,
                r.env_worker_num_cpus,
                r.rollout_interaction_env_path,
                ctx.args,
                cfg.cluster.ray_address,
                retries=r.max_env_retries_per_turn,
            )
            ctx.env_workers.timeline = ctx.timeline
        warn_if_inexact(
            ctx.processor,
            path_of(
                r.context_policy,
                r.context_policy_path,
                r.retokenize_chat_history,
                single_message=not r.conversation_multi_turn,
            ),
        )
        return ctx

    def version_of(self, engine_version: Any) -> int:
        """An engine's ``weight_version`` -> the version number of the weights that generated a token.
        SGLang reports ``"default"`` until its first update: in a run that is the starting weights
        (engines are launched with the run's starting version, and ``--engine-url`` engines get the
        starting weights pushed), so it reads as ``start_version``; NO_VERSION for any other name."""
        if engine_version == "default":
            return self.start_version
        return parse_version(engine_version)

    @property
    def tokenizer(self):
        return tokenizer_of(self.processor)

    def encoder(self, tools: list[dict] | None = None) -> ObservationEncoder:
        """The observation encoder for a tool set (built once per distinct set)."""
        key = json.dumps(tools, sort_keys=True, default=str) if tools else ""
        if key not in self._encoders:
            self._encoders[key] = ObservationEncoder(self.processor, tools=tools)
        return self._encoders[key]

    def prepare_prompt(self, sample) -> None:
        """Set ``sample.tokens`` to its encoded prompt (through the chat template with
        ``--apply-chat-template`` or message prompts, with the row's tools) before a generate function
        sees it; ``run_episode`` takes this encoding (``take_prompt_encoding``) instead of encoding again."""
        if sample.tokens:
            return
        encoded = self.encode_prompt(sample.prompt, (sample.metadata or {}).get("tools"))
        sample.set_prompt_tokens(encoded.ids)
        self._prompt_encodings[id(sample)] = encoded

    def encode_prompt(self, prompt, tools=None) -> Encoded:
        """A row's prompt as the rollout encodes it: through the chat template with
        ``--apply-chat-template`` or when it is messages, with the row's tools."""
        as_messages = self.data.apply_chat_template or not isinstance(prompt, str)
        return self.encoder(tools).encode_prompt(prompt, as_messages)

    def take_prompt_encoding(self, sample) -> Encoded | None:
        """The encoding ``prepare_prompt`` made for ``sample`` (once), if its tokens are still that prompt."""
        encoded = self._prompt_encodings.pop(id(sample), None)
        return encoded if encoded is not None and encoded.ids == sample.tokens else None

    def append_engine_turn(self, sample, response: dict):
        """Append an engine's ``/generate`` answer to ``sample`` as one model turn with its ``Turn``
        record: the output ids, their log-probs, the text, the finish reason and the weight version
        (SGLang's ``"default"`` read as the run's starting version), and its routes under
        ``--use-rollout-routing-replay`` (asked for with ``route_request``). -> the Turn. For custom
        generate functions: with it (and ``append_observation``) step-wise training and merging work."""
        meta = response["meta_info"]
        ids, log_probs = output_of(response)
        version = self.version_of(meta.get("weight_version"))
        self.add_routes(sample, meta)
        return sample.append_turn(
            ids,
            log_probs,
            response.get("text", ""),
            meta["finish_reason"]["type"],
            None if version < 0 else version,
        )

    def route_request(self, sample) -> dict:
        """The ``/generate`` fields that ask for the routes ``sample`` does not hold yet (R3: its new
        context tokens and the output); {} without ``--use-rollout-routing-replay``."""
        if self.route_layout is None:
            return {}
        held = 0 if sample.routed_experts is None else len(sample.routed_experts)
        return {"return_routed_experts": True, "routed_experts_start_len": held}

    def add_routes(self, sample, meta: dict) -> None:
        """Append the rows of an engine answer's ``routed_experts`` to ``sample.routed_experts`` (R3;
        nothing without ``--use-rollout-routing-replay``). An engine that returned none, or rows that do
        not start where the sample's end, is an EngineError naming the cause."""
        layout = self.route_layout
        if layout is None:
            return
        held = layout.empty() if sample.routed_experts is None else sample.routed_experts
        data = meta.get("routed_experts")
        if data is None:
            raise EngineError(
                "the engine returned no routed_experts for --use-rollout-routing-replay; an SGLang server needs "
                "--enable-return-routed-experts (the engines this run launches get it)"
            )
        start = int(meta.get("routed_experts_start_len", len(held)))
        if start != len(held):
            raise EngineError(
                f"routed_experts start at token {start}, but sample {sample.index} holds {len(held)} rows"
            )
        rows = layout.decode(data, f"sample {sample.index} turn {len(sample.turns)}: routed_experts")
        sample.routed_experts = torch.cat([held, rows])

    def append_observation(self, sample, message: dict | str) -> list[int]:
        """Append a chat message (a string: a user message) that answers the last turn, encoded by
        the run's chat template as the delta after the model's tokens (loss mask 0; text only: image
        observations go through ``rollouts.multi_turn``). -> the ids appended, which end with the next
        turn's generation prompt."""
        message = {"role": "user", "content": message} if isinstance(message, str) else message
        encoder = self.encoder((sample.metadata or {}).get("tools"))
        ended = bool(sample.turns) and sample.turns[-1].output_tokens > 0 and sample.tokens[-1] == encoder.eot_id
        encoded = encoder.encode_observation(message, model_ended_turn=ended)
        if encoded.images:
            raise ValueError("append_observation takes text messages; images go through rollouts.multi_turn")
        sample.append_observation(encoded.ids, encoded.text)
        return encoded.ids

    def context_policy(self) -> ContextPolicy | None:
        """The ``--context-policy`` / ``--context-policy-path`` function; None for ``append``, whose
        contexts are the running token sequence (token-in/token-out)."""
        r = self.rollout
        if not rewrites_history(r.context_policy, r.context_policy_path):
            return None
        if self._policy is None:
            self._policy = load_policy(r.context_policy, r.context_policy_path)
        return self._policy

    def build_env(self, sample) -> Any:
        """``build_env(sample=..., args=...)`` of ``--rollout-interaction-env-path`` (None if unset)."""
        path = self.rollout.rollout_interaction_env_path
        if not path:
            return None
        if self._env_module is None:
            module = load_module(path)
            if not callable(getattr(module, "build_env", None)):
                raise PluginError(f"--rollout-interaction-env-path {path}: module defines no build_env(sample, args)")
            self._env_module = module
        return self._env_module.build_env(sample=sample, args=self.args)

    async def open_env(self, sample) -> Any:
        """The episode's environment: ``build_env`` here, or on an environment worker under
        ``--env-num-workers`` (a ``RemoteEnv`` with the same interface). None without an env module."""
        if self.env_workers is not None:
            return await self.env_workers.open_env(sample)
        env = self.build_env(sample)
        return await env if inspect.isawaitable(env) else env  # build_env may be ``async def``

    def sampling_params(self) -> dict:
        """Per-run sampling params from the rollout config (``max_new_tokens`` is set per turn)."""
        r = self.rollout
        params = {
            "temperature": r.rollout_temperature,
            "top_p": r.rollout_top_p,
            "top_k": r.rollout_top_k,
            "max_new_tokens": r.rollout_max_response_len,
            "no_stop_trim": True,
        }
        if r.rollout_stop:
            params["stop"] = list(r.rollout_stop)
        if r.rollout_stop_token_ids:
            params["stop_token_ids"] = list(r.rollout_stop_token_ids)
        return params

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The run's event loop, on its own thread: the engine client's connections live on it, and
        sync callers (slime's ``generate_rollout`` contract, the trainer) submit work to it."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="slime-mt-rollout-loop", daemon=True).start()
        return self._loop

    def run_sync(self, coro) -> Any:
        """Run a coroutine on the run's loop from synchronous code and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def submit(self, coro) -> concurrent.futures.Future:
        """Start a coroutine on the run's loop from synchronous code -> its future (do not wait)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        if self.compat is not None:
            self.compat.close()
        if self._loop is not None:
            if self.gateway is not None:
                self.run_sync(self.gateway.stop())
                self.gateway = None
            if self.judge is not None:
                self.run_sync(self.judge.close())
                self.judge = None
            self.run_sync(self.client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
        self.env_executor.shutdown(wait=False, cancel_futures=True)
        if self.rollout_workers is not None:  # before the environment workers they share
            self.rollout_workers.close()
            self.rollout_workers = None
        if self.env_workers is not None:
            self.env_workers.close()
            self.env_workers = None
