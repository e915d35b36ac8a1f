"""Reading a run: its dumps, turn records, replay of a step, the text report and the viewer page."""
