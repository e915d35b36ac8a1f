"""Core data types: Sample (one trajectory, slime's field names), Turn (one LLM call), Status,
TrainingSample (one sequence to train on), and what passes between the roles: a step's groups from a
``BatchSource`` (``Batch``) and the ``TrainBatch`` the ranks train on.

Invariants of a Sample (``Sample.validate`` asserts them):
  tokens = prompt tokens + response tokens, ``response_length = len(tokens) - prompt_length``;
  ``len(loss_mask) == len(rollout_log_probs) == response_length``, unless ``rollout_log_probs`` is
  None: a re-tokenized history (``--retokenize-chat-history`` with concat) whose assistant tokens
  were never sampled as such;
  loss_mask is 1 exactly on model-generated tokens, 0 on observation tokens (whose log-prob is 0.0);
  ``token_versions`` is empty (not recorded) or has ``response_length`` entries: the weight version
  that generated each response token, ``NO_VERSION`` (-1) on observation tokens and where the engine
  named no numeric version. A turn interrupted by a weight update and resumed (``--partial-rollout``)
  holds tokens of two versions;
  turns are in order, each turn's output lies inside the response and is all loss_mask 1;
  ``routed_experts`` (MoE, ``--use-rollout-routing-replay``) has at most ``len(tokens)`` rows: row i
  holds the experts the engine routed token i to (``slime_mt/routes.py``).
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
import torch

from slime_mt.errors import SampleError

NO_VERSION = -1  # the version of a token no policy generated (observations), or of an unnamed one


def parse_version(value: Any) -> int:
    """An engine's ``weight_version`` (a string in SGLang's protocol) -> int; NO_VERSION unless it is a
    non-negative decimal number (SGLang's default is "default")."""
    text = str(value) if value is not None else ""
    return int(text) if text.isdigit() else NO_VERSION


class Status(str, Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class Turn:
    """One LLM call of a trajectory.

    The model saw ``tokens[:output_start]`` (``context_end``), unless the rollout rewrote history,
    in which case ``context_ids`` holds the exact context sent (image pads expanded). The turn's
    output is ``tokens[output_start:output_end]``; the observation that followed is
    ``tokens[output_end:observation_end]``.
    """

    output_start: int
    output_end: int
    observation_end: int
    finish_reason: str | None = None
    weight_version: str | None = None
    engine_seconds: float = 0.0
    env_seconds: float = 0.0
    env_retries: int = 0
    env_info: dict = field(default_factory=dict)
    num_images: int = 0
    context_ids: list[int] | None = None
    image_indices: list[int] | None = None  # images of a rewritten context (default: the first num_images)
    reward: float | None = None  # the env's info["reward"] for this turn, when it gave one

    @property
    def context_end(self) -> int:
        return self.output_start

    @property
    def output_tokens(self) -> int:
        return self.output_end - self.output_start

    @property
    def observation_tokens(self) -> int:
        return self.observation_end - self.output_end


@dataclass
class Sample:
    """One trajectory: prompt, every turn's output and observation, and what training needs."""

    index: int | None = None
    group_index: int | None = None
    prompt: str | list[dict] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict | None = None
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] | None = field(default_factory=list)  # None: not sampled (see above)
    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    multimodal_inputs: dict | None = None
    multimodal_train_inputs: dict | None = None
    weight_versions: list[str] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    token_versions: list[int] | None = field(default_factory=list)  # per response token; see module docstring
    routed_experts: torch.Tensor | None = None  # MoE: [rows <= len(tokens), moe_layers, top_k]; routes.py

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def generated_tokens(self) -> int:
        """Tokens the model generated: its turns' outputs, or the loss mask of a sample a generate
        function built without ``Turn`` records."""
        if self.turns or not self.loss_mask:
            return sum(t.output_tokens for t in self.turns)
        return sum(self.loss_mask)

    def clear_response(self) -> None:
        """Drop every response token and turn record: the trajectory starts again from its prompt."""
        del self.tokens[self.prompt_length :]
        self.response, self.response_length = "", 0
        self.loss_mask, self.turns, self.weight_versions = [], [], []
        self.rollout_log_probs, self.token_versions = [], []
        if self.routed_experts is not None:
            self.routed_experts = self.routed_experts[: len(self.tokens)]

    def set_prompt_tokens(self, ids: list[int]) -> None:
        """Start the trajectory from its encoded prompt; only allowed before any response token."""
        if self.response_length:
            raise SampleError(f"sample {self.index}: prompt set after {self.response_length} response tokens")
        self.tokens = list(ids)

    def append_model_tokens(
        self, ids: list[int], log_probs: list[float], text: str = "", version: int = NO_VERSION
    ) -> None:
        """Append tokens the model generated: trainable (mask 1) with their rollout log-probs and the
        weight version that generated them."""
        if len(ids) != len(log_probs):
            raise SampleError(f"sample {self.index}: {len(ids)} generated tokens but {len(log_probs)} log-probs")
        self._extend_versions(len(ids), version)
        self.tokens.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.rollout_log_probs.extend(float(x) for x in log_probs)
        self.response_length += len(ids)
        self.response += text

    def append_model_runs(self, ids: list[int], log_probs: list[float], versions: list[int], text: str = "") -> None:
        """Append generated tokens whose weight version may change along them (``versions``: one per
        token, as a turn resumed across an update holds): one append per run of one version, the text
        with the last."""
        if len(versions) != len(ids):
            raise SampleError(f"sample {self.index}: {len(ids)} generated tokens but {len(versions)} versions")
        start = 0
        for version, run in itertools.groupby(versions):
            end = start + len(list(run))
            self.append_model_tokens(ids[start:end], log_probs[start:end], text if end == len(ids) else "", version)
            start = end
        if not ids:
            self.append_model_tokens([], [], text)

    def append_observation_tokens(self, ids: list[int], text: str = "") -> None:
        """Append tokens the framework encoded (env observation, template glue): mask 0, log-prob 0.0."""
        self._extend_versions(len(ids), NO_VERSION)
        self.tokens.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.rollout_log_probs.extend([0.0] * len(ids))
        self.response_length += len(ids)
        self.response += text

    def append_turn(
        self,
        ids: list[int],
        log_probs: list[float],
        text: str = "",
        finish_reason: str | None = "stop",
        weight_version: Any = None,
    ) -> Turn:
        """Append one model turn (trainable tokens with their rollout log-probs) and its ``Turn``
        record, which step-wise training, merging and the turn metrics read. The model saw every token
        before it (append-only context). -> the Turn (``append_observation`` extends it)."""
        start = len(self.tokens)
        self.append_model_tokens(ids, log_probs, text, parse_version(weight_version))
        turn = Turn(
            output_start=start,
            output_end=len(self.tokens),
            observation_end=len(self.tokens),
            finish_reason=finish_reason,
            weight_version=None if weight_version is None else str(weight_version),
        )
        self.turns.append(turn)
        if turn.weight_version is not None:
            self.weight_versions.append(turn.weight_version)
        return turn

    def append_observation(self, ids: list[int], text: str = "") -> None:
        """Append what answered the last turn (env output, template glue: loss mask 0) to that turn's
        record; prompt tokens go through ``set_prompt_tokens``."""
        if not self.turns:
            raise SampleError(
                f"sample {self.index}: an observation before any model turn; append the turn first "
                "(append_turn), or make these tokens part of the prompt (set_prompt_tokens)"
            )
        self.append_observation_tokens(ids, text)
        self.turns[-1].observation_end = len(self.tokens)

    def drop_last_model_token(self) -> int:
        """Remove the last response token, which must be a generated one -> its id."""
        if not self.response_length or self.loss_mask[-1] != 1:
            raise SampleError(f"sample {self.index}: the last response token is not a generated one")
        self.response_length -= 1
        self.loss_mask.pop()
        self.rollout_log_probs.pop()
        if self.token_versions:
            self.token_versions.pop()
        return self.tokens.pop()

    def _extend_versions(self, count: int, version: int) -> None:
        if self.token_versions is None:
            return
        if len(self.token_versions) != self.response_length:  # a response built without versions
            if self.token_versions:
                raise SampleError(
                    f"sample {self.index}: {len(self.token_versions)} token versions for "
                    f"{self.response_length} response tokens"
                )
            if self.response_length:
                self.token_versions = None
                return
        self.token_versions.extend([int(version)] * count)

    def validate(self) -> None:
        """Raise SampleError on the first broken invariant (see module docstring)."""
        n = self.response_length
        if n < 0 or n > len(self.tokens):
            raise SampleError(f"sample {self.index}: response_length {n} outside 0..{len(self.tokens)}")
        if len(self.loss_mask) != n:
            raise SampleError(f"sample {self.index}: len(loss_mask)={len(self.loss_mask)} != response_length={n}")
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != n:
            raise SampleError(
                f"sample {self.index}: len(rollout_log_probs)={len(self.rollout_log_probs)} != response_length={n}"
            )
        if self.token_versions and len(self.token_versions) != n:
            raise SampleError(
                f"sample {self.index}: len(token_versions)={len(self.token_versions)} != response_length={n}"
            )
        bad = [m for m in self.loss_mask if m not in (0, 1)]
        if bad:
            raise SampleError(f"sample {self.index}: loss_mask holds {bad[0]!r}; only 0 and 1 are allowed")
        start = self.prompt_length
        previous_end = start
        for k, turn in enumerate(self.turns):
            where = f"sample {self.index} turn {k}"
            if not (previous_end <= turn.output_start <= turn.output_end <= turn.observation_end <= len(self.tokens)):
                raise SampleError(
                    f"{where}: spans output=[{turn.output_start},{turn.output_end}) "
                    f"observation_end={turn.observation_end} out of order (previous end {previous_end}, "
                    f"{len(self.tokens)} tokens)"
                )
            mask = self.loss_mask[turn.output_start - start : turn.output_end - start]
            if any(m != 1 for m in mask):
                raise SampleError(f"{where}: generated tokens with loss_mask 0")
            obs = self.loss_mask[turn.output_end - start : turn.observation_end - start]
            if any(m != 0 for m in obs):
                raise SampleError(f"{where}: observation tokens with loss_mask 1")
            previous_end = turn.observation_end
        if self.routed_experts is not None and len(self.routed_experts) > len(self.tokens):
            raise SampleError(
                f"sample {self.index}: {len(self.routed_experts)} rows of routed experts for {len(self.tokens)} tokens"
            )
        if self.turns and sum(self.loss_mask) != sum(t.output_tokens for t in self.turns):
            raise SampleError(
                f"sample {self.index}: {sum(self.loss_mask)} trainable tokens but turns generated "
                f"{sum(t.output_tokens for t in self.turns)}"
            )

    def to_dict(self) -> dict:
        """JSON-safe dict; tensors become {'__tensor__': dtype, 'shape', 'data': base64}."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["status"] = self.status.value
        out["turns"] = [dataclasses.asdict(t) for t in self.turns]
        out["multimodal_inputs"] = _encode(self.multimodal_inputs)
        out["multimodal_train_inputs"] = _encode(self.multimodal_train_inputs)
        out["routed_experts"] = _encode(self.routed_experts)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Sample:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise SampleError(f"Sample.from_dict: unknown keys {sorted(unknown)}")
        kw = dict(data)
        kw["status"] = Status(kw.get("status", Status.PENDING))
        kw["turns"] = [Turn(**t) for t in kw.get("turns", [])]
        kw["multimodal_inputs"] = _decode(kw.get("multimodal_inputs"))
        kw["multimodal_train_inputs"] = _decode(kw.get("multimodal_train_inputs"))
        kw["routed_experts"] = _decode(kw.get("routed_experts"))
        return cls(**kw)


def _encode(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        array = value.detach().cpu().contiguous()
        dtype = str(array.dtype).removeprefix("torch.")
        raw = array.view(torch.int16).numpy().tobytes() if array.dtype == torch.bfloat16 else array.numpy().tobytes()
        return {"__tensor__": dtype, "shape": list(array.shape), "data": base64.b64encode(raw).decode()}
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and "__tensor__" in value:
        dtype = getattr(torch, value["__tensor__"])
        raw = base64.b64decode(value["data"])
        if dtype == torch.bfloat16:
            return (
                torch.from_numpy(np.frombuffer(raw, dtype=np.int16).copy()).view(torch.bfloat16).reshape(value["shape"])
            )
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        return torch.from_numpy(np.frombuffer(raw, dtype=np_dtype).copy()).reshape(value["shape"])
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


@dataclass
class TrainingSample:
    """One sequence to train on: a whole trajectory (concat) or one LLM turn (step-wise).

    ``response_ids``, ``loss_mask``, ``rollout_log_probs`` and ``token_versions`` have equal lengths;
    observation tokens inside a response have mask 0, log-prob 0.0 and version NO_VERSION;
    ``token_versions`` None: not recorded. ``rollout_log_probs`` None: the engine never sampled
    these tokens as such (a re-tokenized history); the trainer's old log-probs stand in.
    ``trajectory_id`` ties the steps of one trajectory together; ``group_id`` is its prompt group;
    ``is_last_step`` marks its final step; ``turns`` the trajectory's turns it holds (step-wise: one,
    more where steps were merged; None: all of them, concat); ``routed_experts`` the engine's routes of
    its first tokens (MoE with ``--use-rollout-routing-replay``; ``slime_mt/routes.py``).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    rollout_log_probs: list[float] | None
    reward: float
    trajectory_id: str
    group_id: int
    is_last_step: bool
    stop_reason: str | None = None
    multimodal_train_inputs: dict | None = None
    status: Status = Status.COMPLETED
    token_versions: list[int] | None = None
    turns: list[int] | None = None
    routed_experts: torch.Tensor | None = None  # [rows <= len(tokens), moe_layers, top_k]

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def num_trainable(self) -> int:
        return sum(self.loss_mask)


@dataclass
class TrainBatch:
    """What the ranks train on in one step (made by the rollout role from a ``Batch``)."""

    samples: list[TrainingSample]
    advantages: list[float]
    merge_metrics: dict
    rollout_metrics: dict
    rollout_seconds: float
    rollout_started: float
    metrics: dict[str, float]  # weight versions, staleness, the batch source's timings
    trained_groups: list[int]  # the groups' indices (metrics.jsonl records them)
    note: str  # the step's failures in one line


@dataclass
class Batch:
    """A step's groups as a ``BatchSource`` gives them."""

    groups: list
    started: float  # wall clock when its rollout started
    seconds: float  # how long the rollout took (fully async: how long the trainer waited)
    metrics: dict[str, float] = field(default_factory=dict)


class BatchSource:
    """Where each step's groups come from, one per mode (``roles/batches.py``; a train-only run's dumps:
    ``inspection/replay.py``). The rollout role (``roles/rollout.py``, ``roles/steps.py``) calls
    ``take(step)`` for the step's groups, ``prefetch`` once the step's batch is prepared, ``drain`` once
    it has trained (before the weights change) and ``weights_changed`` after they have; ``data_state``
    is what a checkpoint saves of the data cursor so that a resumed run draws again what was drawn and
    not trained. The defaults: nothing in flight."""

    def take(self, step: int) -> Batch:
        raise NotImplementedError(f"{type(self).__name__} gives no batches")

    def prefetch(self, step: int, metrics: dict[str, float]) -> None:
        """The step's batch is prepared and will train (not called when the run stops after it)."""

    def drain(self) -> float:
        """The step has trained; -> seconds spent waiting before the weights may change."""
        return 0.0

    def weights_changed(self, version: int) -> None:
        """The engines now serve ``version``."""

    def idle_metrics(self, train_seconds: float, sync_seconds: float) -> dict[str, float]:
        """What the engines waited for this step."""
        return {}

    def data_state(self) -> dict:
        return {}

    def close(self) -> None:
        pass
