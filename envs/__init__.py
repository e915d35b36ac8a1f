"""Interaction environments (``--rollout-interaction-env-path``): the ``BaseInteractionEnv`` API and
ready environments."""
