"""slime.utils.types: slime's ``Sample``, a ``slime_mt.types.Sample`` with slime's nested ``Status``,
its extra fields and ``append_response_tokens``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slime_mt import types as core
from slime_mt.compat.run_state import current

__all__ = ["Sample"]


@dataclass
class Sample(core.Sample):
    Status = core.Status  # slime's Sample.Status.COMPLETED ...

    rollout_id: int | None = None
    session_id: str | None = None
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    remove_sample: bool = False  # trained with loss mask 0 (slime)
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    non_generation_time: float = 0.0
    teacher_log_probs: list[float] | None = None

    def append_response_tokens(
        self,
        args=None,
        *,
        tokens=None,
        log_probs=None,
        trainable: bool = True,
        meta_info: dict | None = None,
        text: str | None = None,
        update_terminal_info: bool = True,
    ) -> None:
        """slime's helper: response tokens (trainable: the model's, with their log-probs; else the
        environment's, loss mask 0, log-prob 0.0), the text, and from an engine's ``meta_info`` the
        weight version and the status its finish reason means (length: TRUNCATED, abort: ABORTED,
        stop: COMPLETED). Trainable tokens without log-probs leave the sample without rollout
        log-probs (the trainer's own stand in)."""
        ids = [int(t) for t in (tokens.tolist() if hasattr(tokens, "tolist") else tokens or [])]
        if log_probs is not None:
            log_probs = [float(x) for x in (log_probs.tolist() if hasattr(log_probs, "tolist") else log_probs)]
            if len(log_probs) != len(ids):
                raise ValueError(f"sample {self.index}: {len(log_probs)} log-probs for {len(ids)} tokens")
        if self.loss_mask is None:
            self.loss_mask = [1] * self.response_length
        if ids:
            version = core.NO_VERSION
            if trainable and meta_info:
                compat = current()
                engine_version = meta_info.get("weight_version")
                version = compat.ctx.version_of(engine_version) if compat else core.parse_version(engine_version)
            self._extend_versions(len(ids), version)
            if self.rollout_log_probs is not None and len(self.rollout_log_probs) != self.response_length:
                self.rollout_log_probs = None
            if self.rollout_log_probs is not None:
                if not trainable:
                    self.rollout_log_probs.extend([0.0] * len(ids))
                elif log_probs is None:
                    self.rollout_log_probs = None
                else:
                    self.rollout_log_probs.extend(log_probs)
            self.tokens.extend(ids)
            self.loss_mask.extend([int(trainable)] * len(ids))
            self.response_length += len(ids)
        if text is not None:
            self.response += text
        if meta_info and update_terminal_info and "finish_reason" in meta_info:
            if "weight_version" in meta_info:
                self.weight_versions.append(str(meta_info["weight_version"]))
            status = {"length": core.Status.TRUNCATED, "abort": core.Status.ABORTED, "stop": core.Status.COMPLETED}
            self.status = status.get(meta_info["finish_reason"]["type"], self.status)

    def get_reward_value(self, args) -> Any:
        key = getattr(args, "reward_key", None)
        return self.reward[key] if key else self.reward

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length
