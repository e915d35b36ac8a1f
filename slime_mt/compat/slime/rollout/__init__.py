"""slime.rollout: sglang_rollout, base_types, rm_hub, filter_hub."""
