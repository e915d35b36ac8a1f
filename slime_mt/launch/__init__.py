"""Launchers: they give each process its roles (``roles/``) and run the driver there: ``ranks`` for one
process and ``torchrun``, ``ray`` for ``--ray``."""
