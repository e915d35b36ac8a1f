"""The same agent as a separate program, for ``--agent-command 'python examples/openai_agent/command_agent.py'``:
the sample arrives as JSON on stdin, the session's URL and key in ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``,
and the reward leaves as JSON on stdout."""

import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent import run_agent  # noqa: E402

if __name__ == "__main__":
    sample = json.load(sys.stdin)
    result = asyncio.run(run_agent(os.environ["OPENAI_BASE_URL"], sample, None))
    print(json.dumps(result))
