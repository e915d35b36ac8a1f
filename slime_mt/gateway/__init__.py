"""The agent gateway: an OpenAI-compatible (and Anthropic Messages) server in front of the engine
client that records every call's exact tokens, so agents written against those APIs train step-wise.
See ``server.py`` for the endpoints, ``session.py`` for what is recorded and exact."""
