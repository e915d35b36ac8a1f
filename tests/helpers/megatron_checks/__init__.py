"""The Megatron checks, one module per part of the backend (``model``, ``scoring``, ``train``, ``export``,
``parallel``, ``state``), each with its ``CHECKS``; ``megatron_worker.py`` runs them in launched worlds."""
