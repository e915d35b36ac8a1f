"""Build Samples by hand: a prompt, then per turn (output ids, their log-probs, observation ids)."""

from slime_mt.types import Sample, Status, Turn


def make_sample(prompt, turns, reward=1.0, group=0, index=0, status=Status.COMPLETED, contexts=None):
    """``turns``: list of (output_ids, output_logprobs, observation_ids). ``contexts``: optional
    rewritten context per turn (None = the running prefix)."""
    s = Sample(index=index, group_index=group, prompt="p", reward=reward, status=status)
    s.set_prompt_tokens(list(prompt))
    for k, (out, lps, obs) in enumerate(turns):
        start = len(s.tokens)
        s.append_model_tokens(list(out), list(lps))
        end = len(s.tokens)
        s.append_observation_tokens(list(obs))
        context = contexts[k] if contexts else None
        s.turns.append(
            Turn(
                output_start=start,
                output_end=end,
                observation_end=len(s.tokens),
                finish_reason="stop",
                context_ids=context,
            )
        )
    s.metadata["termination"] = "env_done"
    s.validate()
    return s
