"""A custom generate function: the demo's secret-word game written as one function, with no
environment class.

    slime-mt train --config examples/demo/config.yaml \
        --custom-generate-function-path examples/custom_generate/generate.py:generate ...

What the framework fills in before the call: ``sample.tokens`` (the prompt encoded, through the chat
template with ``--apply-chat-template`` or message prompts), ``sample.prompt``, ``sample.label``,
``sample.metadata``, and ``args.rollout_context`` (the engine client, the tokenizer, the helpers used
here). What the function fills in: the turns, through ``ctx.append_engine_turn`` and
``ctx.append_observation``, which keep the ``Turn`` records that step-wise training, merging and the
turn metrics read; ``sample.status`` (left PENDING it becomes COMPLETED, or TRUNCATED when the last
turn hit the length limit); and ``sample.reward``, kept unless ``--custom-rm-path`` is set.
"""

import re

from slime_mt.rollout.multi_turn import turn_seed
from slime_mt.types import Status


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


async def generate(args, sample, sampling_params):
    ctx = args.rollout_context
    secret = str(sample.label).lower()
    sample.reward = 0.0
    for turn in range(2):
        room = args.rollout_max_context_len - len(sample.tokens)
        if room <= 0:
            sample.status = Status.TRUNCATED
            return sample
        params = dict(sampling_params, max_new_tokens=min(sampling_params["max_new_tokens"], room))
        # a seed per (run seed, step, sample, turn), as the framework's own turn loop uses: the run samples
        # the same again whatever else the engine is batching
        params["sampling_seed"] = turn_seed(args.rollout_seed, sample.metadata["rollout_id"], sample.index, turn)
        response = await ctx.client.generate(sample.tokens, params)
        ctx.append_engine_turn(sample, response)  # output ids, log-probs, text, finish reason, version
        words = _words(response["text"])
        if secret in words:  # 1.0 for the word alone, less for every extra word
            sample.reward = 1.0 / (1.0 + 0.25 * (len(words) - 1))
            return sample
        if turn == 0:  # the observation: the chat template's user turn, then the next generation prompt
            ctx.append_observation(sample, f"No. The secret word is '{secret}'. Now reply with only the secret word.")
    return sample
