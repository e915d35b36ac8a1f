"""slime's module layout, mapped onto slime_mt (``import slime`` under ``--slime-compat``)."""
