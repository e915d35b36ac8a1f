"""slime.rollout.filter_hub.base_types: a filter's verdict (``keep``, ``reason``)."""

from dataclasses import dataclass


@dataclass
class DynamicFilterOutput:
    keep: bool
    reason: str | None = None
