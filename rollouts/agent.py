"""Agents behind an OpenAI-compatible API, trained step-wise: ``--custom-generate-function-path
rollouts.agent.generate`` with one of

  --agent-function-path module.fn | file.py:fn
      ``async def run_agent(base_url: str, sample, args) -> float | dict | None``, run once per sample
      on the rollout's event loop (a plain ``def`` runs in a thread of its own, so a blocking client is
      fine). ``base_url`` is the sample's session (``http://HOST:PORT/sessions/{sid}/v1``): give it to
      ``openai.AsyncOpenAI(base_url=..., api_key=args.gateway_api_key)``; the Anthropic client's
      ``base_url`` is the same without ``/v1``.
  --agent-command 'python my_agent.py'
      a program run once per sample (in its own process group) with ``OPENAI_BASE_URL``,
      ``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL`` and ``ANTHROPIC_API_KEY`` in its environment and the
      sample as JSON on stdin (``index``, ``group_index``, ``prompt``, ``label``, ``metadata``); it
      prints the reward as JSON on stdout (a number, or an object; the last line that parses counts).

The return value is the reward: a number, or a dict whose ``reward`` is (its other numbers become
``agent/<key>`` metrics). With ``--custom-rm-path`` the reward function decides instead and finds
what the agent returned in ``sample.metadata["agent_result"]``.

Every call the agent makes is a turn of the sample (``slime_mt/gateway/session.py``): with
``--sample-format step_wise`` each call trains on exactly the ids the engine received and produced,
and ``--merge-step-wise`` joins the calls whose history only grew. An exception, a non-zero exit or
``--agent-timeout`` makes the sample FAILED with the error kept (``sample.metadata["error"]``), and its
calls still in flight are aborted; a sample without any call is FAILED too (nothing to train on). A
call refused because the context is full (``--rollout-max-context-len``) ends the sample TRUNCATED.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import os
import signal

from slime_mt.engine.http import within
from slime_mt.gateway.server import open_gateway
from slime_mt.plugins import load_function
from slime_mt.rollout.failures import fail
from slime_mt.types import Sample, Status

STDERR_TAIL = 2000  # characters of a failed command's stderr kept in the error


class AgentError(RuntimeError):
    """An agent that could not give a result; the message says what it did instead."""


def _expected_agent(base_url, sample, args):
    """Contract of --agent-function-path (``async def``, or a plain ``def`` run in a thread)."""


def sample_json(sample: Sample) -> dict:
    """What an ``--agent-command`` reads on stdin."""
    return {
        "index": sample.index,
        "group_index": sample.group_index,
        "prompt": sample.prompt,
        "label": sample.label,
        "metadata": sample.metadata,
    }


def parse_result(stdout: str):
    """The reward JSON a command printed: the whole output, else its last line that parses."""
    text = stdout.strip()
    candidates = [text, *reversed([line.strip() for line in text.splitlines() if line.strip()])]
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(value, (int, float, dict)) and not isinstance(value, bool):
            return value
    raise AgentError(f"--agent-command printed no reward JSON (a number or an object) on stdout: {text[-300:]!r}")


async def run_command(command: str, base_url: str, api_key: str | None, sample: Sample):
    """Run ``--agent-command`` for one sample -> the reward JSON it printed. Cancelled (a timeout), its
    whole process group is killed."""
    key = api_key or "EMPTY"
    env = dict(
        os.environ,
        OPENAI_BASE_URL=base_url,
        OPENAI_API_KEY=key,
        ANTHROPIC_BASE_URL=base_url.removesuffix("/v1"),
        ANTHROPIC_API_KEY=key,
    )
    process = await asyncio.create_subprocess_shell(
        command,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    payload = json.dumps(sample_json(sample), default=str).encode()
    try:
        stdout, stderr = await process.communicate(payload)
    except BaseException:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
        raise
    if process.returncode != 0:
        tail = stderr.decode(errors="replace")[-STDERR_TAIL:]
        raise AgentError(f"--agent-command exited with status {process.returncode}; stderr: {tail}")
    return parse_result(stdout.decode(errors="replace"))


async def _run_agent(ctx, base_url: str, sample: Sample, api_key: str | None):
    cfg = ctx.gateway_config
    if cfg.agent_command:
        return await run_command(cfg.agent_command, base_url, api_key, sample)
    fn = load_function(cfg.agent_function_path, _expected_agent, "--agent-function-path")  # modules load once
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
        return await fn(base_url, sample, ctx.args)
    result = await asyncio.to_thread(fn, base_url, sample, ctx.args)
    return await result if inspect.isawaitable(result) else result


def _take_result(ctx, sample: Sample, result) -> None:
    """The agent's return value -> the sample's reward (or, with a reward function, its metadata)."""
    sample.metadata["agent_result"] = result
    reward = result.get("reward") if isinstance(result, dict) else result
    if isinstance(result, dict):
        sample.metadata["agent_metrics"] = {
            k: float(v)
            for k, v in result.items()
            if k != "reward" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
    if ctx.rollout.custom_rm_path or ctx.rollout.rm_type:
        return
    if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
        raise AgentError(
            f"the agent returned {json.dumps(result, default=str)[:200]}; without --custom-rm-path it must return "
            "the reward: a finite number, or a dict with a numeric 'reward'"
        )
    sample.reward = float(reward)


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    """One sample through the user's agent, every model call through a fresh gateway session."""
    ctx = args.rollout_context
    cfg = ctx.gateway_config
    if bool(cfg.agent_function_path) == bool(cfg.agent_command):
        raise AgentError("rollouts.agent.generate needs exactly one of --agent-function-path and --agent-command")
    gateway = await open_gateway(ctx)
    args.gateway_api_key = gateway.api_key or "EMPTY"
    session = gateway.open(sample, sampling_params)
    try:
        result = await within(_run_agent(ctx, gateway.base_url(session), sample, gateway.api_key), cfg.agent_timeout)
        _take_result(ctx, sample, result)
    except asyncio.TimeoutError:
        fail(
            sample,
            "agent timed out",
            f"the agent ran past --agent-timeout {cfg.agent_timeout}s; its calls were aborted",
        )
    except Exception as e:
        fail(sample, f"agent raised {type(e).__name__}", f"agent raised {type(e).__name__}: {e}", e)
    finally:
        await gateway.close(session)
    if sample.status == Status.FAILED:
        return sample
    if not sample.turns:
        sample.reward = None
        fail(sample, "agent made no model call", "the agent returned without calling the model; nothing to train on")
    elif session.termination is not None:
        sample.status, sample.metadata["termination"] = Status.TRUNCATED, session.termination
    elif sample.turns[-1].finish_reason == "length":
        sample.status, sample.metadata["termination"] = Status.TRUNCATED, "engine_length"
    else:
        sample.status, sample.metadata["termination"] = Status.COMPLETED, "agent_done"
    return sample
