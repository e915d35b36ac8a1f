"""Rollout routing replay (R3): the experts an engine routed each token to, as they travel from the
engine to the trainer.

On the wire (SGLang's ``meta_info["routed_experts"]``, its ``--enable-return-routed-experts`` and a
request's ``return_routed_experts``): base64 of a flat int32 array, shape ``[rows, num_hidden_layers,
top_k]``. Row i is the routing of the i-th token the engine processed, counted from the request's
``routed_experts_start_len``: a response covers tokens ``[routed_experts_start_len, seqlen - 1)``,
seqlen = prompt + output tokens; the last output token was sampled and never processed, so it has no
row. A dense layer's entries hold no expert (-1 here).

In a sample (``Sample.routed_experts``, ``TrainingSample.routed_experts``): a tensor ``[rows,
moe_layers, top_k]`` of the smallest integer type that holds every expert index (uint8 for up to
255 experts, int16 above), the MoE layers only; row i routes token i of the sequence, and rows may
stop short of its end (tokens no engine processed; training routes them itself). ``NO_ROUTE`` (the
type's largest value) marks a row with no engine routing.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np
import torch


def sparse_layers(text_config: dict) -> list[bool]:
    """Which decoder layers of a Qwen3-MoE-style text config are MoE layers: not in
    ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0`` (transformers' rule)."""
    experts = text_config.get("num_experts") or text_config.get("num_local_experts") or 0
    step = text_config.get("decoder_sparse_step", 1) or 1
    dense = set(text_config.get("mlp_only_layers") or [])
    return [bool(experts) and i not in dense and (i + 1) % step == 0 for i in range(text_config["num_hidden_layers"])]


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type that holds expert indices 0..num_experts-1 and ``NO_ROUTE``."""
    return torch.uint8 if num_experts < 255 else torch.int16


def no_route(dtype: torch.dtype) -> int:
    """The value that marks a row without an engine routing."""
    return torch.iinfo(dtype).max


@dataclass(frozen=True)
class RouteLayout:
    """How a model's routes are shaped: every decoder layer on the wire, the MoE ones in a sample."""

    num_layers: int
    moe_layers: tuple[int, ...]
    top_k: int
    num_experts: int

    @classmethod
    def of(cls, config: dict) -> RouteLayout | None:
        """The layout of an HF config (a VLM's text part); None for a model without experts."""
        text = config.get("text_config", config)
        layers = sparse_layers(text)
        if not any(layers):
            return None
        return cls(
            num_layers=text["num_hidden_layers"],
            moe_layers=tuple(i for i, sparse in enumerate(layers) if sparse),
            top_k=int(text["num_experts_per_tok"]),
            num_experts=int(text.get("num_experts") or text.get("num_local_experts")),
        )

    @property
    def dtype(self) -> torch.dtype:
        return route_dtype(self.num_experts)

    def empty(self) -> torch.Tensor:
        return torch.empty(0, len(self.moe_layers), self.top_k, dtype=self.dtype)

    def encode(self, routes: torch.Tensor) -> str:
        """Wire form (SGLang's): ``routes`` ``[rows, num_layers, top_k]`` (any integer type, -1 for a
        dense layer) -> base64 of int32."""
        return base64.b64encode(routes.to(torch.int32).contiguous().numpy().tobytes()).decode()

    def decode(self, data: str, where: str = "routed_experts") -> torch.Tensor:
        """Wire form -> the sample form ``[rows, moe_layers, top_k]``; ValueError naming ``where`` for
        a payload of the wrong size or an expert index out of range."""
        raw = np.frombuffer(base64.b64decode(data), dtype=np.int32)
        per_row = self.num_layers * self.top_k
        if raw.size % per_row:
            raise ValueError(
                f"{where}: {raw.size} int32 values are not rows of {self.num_layers} layers x {self.top_k} experts"
            )
        rows = torch.from_numpy(raw.copy()).reshape(-1, self.num_layers, self.top_k)[:, list(self.moe_layers)]
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.num_experts):
            raise ValueError(f"{where}: an expert index outside 0..{self.num_experts - 1}")
        return rows.to(self.dtype)

    def bytes_per_token_layer(self) -> float:
        """Bytes a sample spends on one token's routing in one MoE layer."""
        return self.top_k * torch.empty(0, dtype=self.dtype).element_size()


def rows_for(routes: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """The routes of a sequence's first ``length`` tokens (a copy; fewer rows where the engine
    processed fewer), or None."""
    return None if routes is None else routes[:length].clone()


def replay_targets(routes: torch.Tensor | None, length: int, layout_moe: int, top_k: int) -> torch.Tensor:
    """``[length, moe_layers, top_k]`` int64 targets for training: the sample's rows, then -1 (route
    it yourself) for tokens without one (and for ``NO_ROUTE`` rows)."""
    out = torch.full((length, layout_moe, top_k), -1, dtype=torch.int64)
    if routes is not None and len(routes):
        rows = routes[:length].to(torch.int64)
        rows[rows == no_route(routes.dtype)] = -1
        out[: len(rows)] = rows
    return out
