"""Launchers: they wire the roles (``train_loop``, ``rollout_side``, ``batches``) to processes and devices."""
