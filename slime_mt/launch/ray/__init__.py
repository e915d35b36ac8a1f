"""Ray: one placement group per run, trainer ranks and engines as actors on the devices it gives."""
