"""The roles of a run: the rollout role (``rollout``, its batch sources in ``batches``), the train role
every trainer rank plays (``train``), and each rank's end of the rollout role (``link``)."""
