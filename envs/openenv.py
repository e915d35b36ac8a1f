"""Environments served by an OpenEnv server, as ``BaseInteractionEnv``: sandboxes, browsers, games and
simulators that run elsewhere (a container, another machine) plug in unchanged.

An OpenEnv server (``openenv-core``: ``create_app(MyEnvironment, MyAction, MyObservation)`` under
uvicorn) keeps one environment per WebSocket session at ``/ws``. Its HTTP ``/reset`` and ``/step``
build a fresh environment for every request, so a multi-turn episode goes over the session:

  client -> {"type": "reset", "data": {seed, episode_id, ...}}    server -> {"type": "observation",
  client -> {"type": "step", "data": <action fields>}                "data": {"observation": {...},
  client -> {"type": "close"}                                                 "reward": r, "done": d}}
                                                                  or {"type": "error", "data": {message, code}}

One episode is one session: ``reset()`` opens it and returns the server's first observation (it follows
the row's prompt), each model turn is one ``step``, ``close()`` ends it. The server's reward is the
turn's ``info["reward"]``.

The model's text becomes the action (``openenv_action_format``):
  ``text`` (default)  ``{field: the text}``; the field is ``openenv_action_field``, or the action
                      schema's one string field (from the server's ``/schema``)
  ``json``            the text is a JSON object of the action's fields (a fenced ```json block or
                      ``<action>...</action>`` around it allowed); unparseable: an invalid action
An action the server rejects as invalid (``VALIDATION_ERROR``) is an invalid action: its message is
the model's feedback. The observation shown to the model is ``openenv_observation_field`` of the
server's observation, else its one string field, else the observation as JSON.

Faults: a server that cannot be reached, a session that drops (the server restarted or was killed) or
an answer that does not come within ``openenv_timeout`` seconds lose the session's state: the step
raises ``RecoverableEnvError``, so the rollout resets (a new session) and replays the episode's actions
(within ``--max-env-resets``). The server's own exception in ``step`` (``EXECUTION_ERROR``) fails the
sample with its message. Replays need the server's environment to be deterministic given the reset's
``seed`` (set ``openenv_replayable: false`` otherwise: a reset restarts the episode).

Settings (custom YAML keys; the row's ``metadata`` wins): ``openenv_url`` (``http://`` or ``ws://``),
``openenv_action_format``, ``openenv_action_field``, ``openenv_observation_field``,
``openenv_reset`` (a dict of extra reset arguments), ``openenv_timeout`` (default 60),
``openenv_replayable`` (default true). The reset's ``seed`` is the sample's group index (the samples
of a group get the same task) unless ``openenv_reset`` names one.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx

from envs.base import BaseInteractionEnv
from slime_mt.errors import InvalidActionError, RecoverableEnvError

ACTION_FORMATS = ("text", "json")
MAX_MESSAGE_BYTES = 100 * 1024 * 1024  # observations may carry images
_JSON_ACTION = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```|<action>\s*(\{.*?\})\s*</action>", re.DOTALL)
_SCHEMAS: dict[str, dict] = {}  # base URL -> the server's /schema (asked once per process)


def _websockets():
    try:
        import websockets.asyncio.client
        import websockets.exceptions
    except ImportError as e:
        raise ImportError("envs.openenv needs websockets: pip install 'slime_mt[envs]'") from e
    return websockets


class OpenEnvError(RuntimeError):
    """The OpenEnv server answered with an error that no reset helps (its environment raised)."""


def _urls(url: str) -> tuple[str, str]:
    """A server URL (http, https, ws or wss) -> (its HTTP base, its session endpoint)."""
    base = url.rstrip("/")
    if base.endswith("/ws"):
        base = base[: -len("/ws")]
    scheme, sep, rest = base.partition("://")
    if not sep or scheme not in ("http", "https", "ws", "wss"):
        raise ValueError(f"openenv_url {url!r}: expected http://host:port (or ws://, https://, wss://)")
    http = {"ws": "http", "wss": "https"}.get(scheme, scheme)
    ws = {"http": "ws", "https": "wss"}.get(scheme, scheme)
    return f"{http}://{rest}", f"{ws}://{rest}/ws"


async def action_schema(url: str, timeout: float = 30.0) -> dict:
    """The server's action JSON schema (``GET /schema``), asked once per server."""
    base, _ = _urls(url)
    if base not in _SCHEMAS:
        try:
            async with httpx.AsyncClient(timeout=timeout) as client:
                response = await client.get(f"{base}/schema")
            response.raise_for_status()
        except httpx.HTTPError as e:
            raise RecoverableEnvError(f"OpenEnv server {base}: GET /schema failed: {type(e).__name__}: {e}") from e
        _SCHEMAS[base] = response.json()
    return _SCHEMAS[base].get("action") or {}


def text_field(schema: dict, url: str) -> str:
    """The action schema's one string field (``metadata`` aside), the one a model's text fills."""
    fields = [
        name
        for name, spec in (schema.get("properties") or {}).items()
        if name != "metadata" and spec.get("type") == "string"
    ]
    if len(fields) != 1:
        raise ValueError(
            f"OpenEnv server {url}: its action has {len(fields)} string fields {fields}; name the one the "
            "model's text fills with openenv_action_field, or set openenv_action_format: json"
        )
    return fields[0]


def observation_text(observation: dict, field: str | None = None) -> str:
    """The text the model sees of a server observation (see the module docstring)."""
    if field is not None:
        if field not in observation:
            raise OpenEnvError(
                f"the observation has no field {field!r} (openenv_observation_field); it has {sorted(observation)}"
            )
        value = observation[field]
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    strings = [value for value in observation.values() if isinstance(value, str)]
    if len(strings) == 1:
        return strings[0]
    return json.dumps(observation, ensure_ascii=False, sort_keys=True)


def _validation_error(error: dict) -> str:
    """One of pydantic's errors the server sent -> ``field: message``."""
    where = ".".join(str(part) for part in error.get("loc") or ())
    return f"{where}: {error.get('msg', '')}" if where else str(error.get("msg", error))


class OpenEnvEnv(BaseInteractionEnv):
    """One episode of an OpenEnv server's environment over one WebSocket session."""

    def __init__(
        self,
        url: str,
        *,
        action_format: str = "text",
        action_field: str | None = None,
        observation_field: str | None = None,
        reset_args: dict | None = None,
        timeout: float = 60.0,
        replayable: bool = True,
    ) -> None:
        if action_format not in ACTION_FORMATS:
            raise ValueError(f"openenv_action_format {action_format!r}: expected one of {ACTION_FORMATS}")
        self.url = url
        self.base, self.ws_url = _urls(url)
        self.action_format = action_format
        self.action_field = action_field
        self.observation_field = observation_field
        self.reset_args = dict(reset_args or {})
        self.timeout = float(timeout)
        self.replayable = bool(replayable)
        self._ws = None

    # ------------------------------------------------------------------ the session
    async def _open(self) -> None:
        ws = _websockets()
        await self._drop()
        try:
            connect = ws.asyncio.client.connect
            self._ws = await connect(self.ws_url, max_size=MAX_MESSAGE_BYTES, open_timeout=self.timeout)
        except (OSError, TimeoutError, ws.exceptions.InvalidHandshake) as e:
            raise RecoverableEnvError(f"OpenEnv server {self.ws_url} unreachable: {type(e).__name__}: {e}") from e

    async def _drop(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                await asyncio.wait_for(ws.close(), timeout=5)
            except Exception:
                pass  # the session is gone either way

    async def _request(self, message: dict) -> dict:
        """Send one message and read its answer -> the answer's ``data``; a lost session is recoverable."""
        if self._ws is None:
            raise RecoverableEnvError(f"OpenEnv session to {self.ws_url} is not open (the last one was lost)")
        try:
            await self._ws.send(json.dumps(message))
            answer = json.loads(await asyncio.wait_for(self._ws.recv(), timeout=self.timeout))
        except (_websockets().exceptions.ConnectionClosed, OSError) as e:
            await self._drop()
            raise RecoverableEnvError(f"OpenEnv session to {self.ws_url} lost during {message['type']}: {e}") from e
        except TimeoutError as e:
            await self._drop()  # a late answer would be read as the next one's: the session is done
            raise RecoverableEnvError(
                f"OpenEnv server {self.ws_url} did not answer {message['type']} within {self.timeout:g} s "
                "(openenv_timeout)"
            ) from e
        data = answer.get("data") or {}
        if answer.get("type") == "error":
            code, text = data.get("code"), data.get("message", "")
            if code == "VALIDATION_ERROR" and message["type"] == "step":
                details = "; ".join(_validation_error(e) for e in data.get("errors") or []) or text
                raise InvalidActionError(f"The action was rejected: {details}")
            if code in ("CAPACITY_REACHED", "SESSION_ERROR", "FACTORY_ERROR"):
                await self._drop()
                raise RecoverableEnvError(f"OpenEnv server {self.ws_url}: {code}: {text}")
            raise OpenEnvError(f"OpenEnv server {self.ws_url} answered {message['type']} with {code}: {text}")
        if answer.get("type") != "observation":
            raise OpenEnvError(f"OpenEnv server {self.ws_url} answered {message['type']} with {answer!r:.200}")
        return data

    # ------------------------------------------------------------------ the env interface
    async def reset(self) -> dict:
        if self.action_format == "text" and self.action_field is None:
            self.action_field = text_field(await action_schema(self.url, self.timeout), self.url)
        await self._open()
        data = await self._request({"type": "reset", "data": self.reset_args})
        return {"text": observation_text(data.get("observation") or {}, self.observation_field)}

    def action(self, response_text: str) -> dict:
        """The model's text -> the server's action fields (see ``openenv_action_format``)."""
        if self.action_format == "json":
            match = _JSON_ACTION.search(response_text)
            raw = next(g for g in match.groups() if g) if match else response_text.strip()
            try:
                action = json.loads(raw)
            except json.JSONDecodeError as e:
                raise InvalidActionError(f"The action must be a JSON object: {e.msg} at position {e.pos}.") from None
            if not isinstance(action, dict):
                raise InvalidActionError(f"The action must be a JSON object, not {type(action).__name__}.")
            return action
        return {self.action_field: response_text}

    async def step(self, response_text: str) -> tuple[dict, bool, dict]:
        action = self.action(response_text)
        data = await self._request({"type": "step", "data": action})
        info: dict[str, Any] = {}
        if data.get("reward") is not None:
            info["reward"] = float(data["reward"])
        observation = {"text": observation_text(data.get("observation") or {}, self.observation_field)}
        return observation, bool(data.get("done")), info

    async def close(self) -> None:
        if self._ws is not None:
            try:
                await asyncio.wait_for(self._ws.send(json.dumps({"type": "close"})), timeout=5)
            except Exception:
                pass  # the server ends the session when the socket closes, too
        await self._drop()


def _setting(metadata: dict, args, key: str, default=None):
    """The row's ``metadata[key]``, else the custom setting ``key``, else ``default``."""
    for value in (metadata.get(key), getattr(args, key, None)):
        if value is not None:
            return value
    return default


def build_env(sample=None, args=None, **kw) -> OpenEnvEnv:
    _websockets()  # a missing client library is named when the env is built
    metadata = (sample.metadata if sample is not None else None) or {}
    url = _setting(metadata, args, "openenv_url")
    if not url:
        raise ValueError("envs.openenv: no server; give the row's metadata['openenv_url'] or the setting openenv_url")
    reset_args = dict(_setting(metadata, args, "openenv_reset", {}) or {})
    if "seed" not in reset_args and sample is not None and sample.group_index is not None:
        reset_args["seed"] = int(sample.group_index)  # a group's samples get the same task (GRPO compares them)
    replayable = _setting(metadata, args, "openenv_replayable", True)
    return OpenEnvEnv(
        url,
        action_format=str(_setting(metadata, args, "openenv_action_format", "text")),
        action_field=_setting(metadata, args, "openenv_action_field"),
        observation_field=_setting(metadata, args, "openenv_observation_field"),
        reset_args=reset_args,
        timeout=float(_setting(metadata, args, "openenv_timeout", 60.0)),
        replayable=replayable not in (False, "false", "False", 0),
    )
