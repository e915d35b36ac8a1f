"""Ready rollout and generate functions that users pass by path (``--rollout-function-path``,
``--custom-generate-function-path``)."""
