"""What the roles use of a Ray cluster (``--ray``, ``--env-num-workers``, ``--rollout-num-processes``):
joining it and working as the driver does (``runtime``), pools of restartable actors (``pool``), the
supervisor that starts an engine again (``supervisor``). The launcher (``launch/ray``) places and
starts the run's own actors."""
