"""``--retokenize-chat-history``: what a trajectory trains when its history was re-rendered.

Every turn's context was the template's render of the conversation, tokenized in one piece (no
token-in/token-out), and the turn recorded it (``Turn.context_ids``), so step-wise samples train
exactly what each call saw and generated, with its rollout log-probs.

At the end of the episode the whole conversation is rendered once more, with an assistant mask
(``ObservationEncoder.encode_with_assistant_mask``). With ``--sample-format concat`` that render is
the sample, as SkyRL trains it: its tokens, the mask on the turns' assistant spans, the turns moved
onto those spans, and no rollout log-probs (``rollout_log_probs`` None: the re-tokenized assistant
tokens were never sampled as such, so the trainer's recomputed log-probs are the old policy and
TIS cannot be used). In both formats the render is compared with what was generated: a turn's drift
is the number of tokens outside the longest matching blocks of its generated ids and its
re-tokenized assistant span, the larger of the two sides (``" ans" + "wer"`` re-tokenized as
``" answer"`` is 2; thinking a template strips from an earlier turn counts every stripped token).
"""

from __future__ import annotations

import difflib

from slime_mt.errors import EncodingError
from slime_mt.tokenization import ObservationEncoder, mask_runs
from slime_mt.types import Sample


def drift(generated: list[int], retokenized: list[int]) -> int:
    """Tokens on either side outside the matching blocks; the larger count."""
    matcher = difflib.SequenceMatcher(None, generated, retokenized, autojunk=False)
    matched = sum(block.size for block in matcher.get_matching_blocks())
    return max(len(generated), len(retokenized)) - matched


def common_ends(a: list[int], b: list[int]) -> tuple[int, int]:
    """The lengths of the longest common prefix of ``a`` and ``b`` and of their longest common suffix
    after it (together at most the shorter length)."""
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    return head, tail


def retokenize_history(sample: Sample, encoder: ObservationEncoder, conversation: list[dict], as_concat: bool) -> int:
    """Render the finished conversation with its assistant mask, record the drift in
    ``sample.metadata["retokenize_drift_tokens"]`` and, ``as_concat``, make the render the sample.
    -> the drift in tokens."""
    encoded, mask = encoder.encode_with_assistant_mask(conversation)
    runs = mask_runs(mask)
    if len(runs) < len(sample.turns):
        raise EncodingError(
            f"sample {sample.index}: {len(sample.turns)} turns but the re-rendered conversation "
            f"has {len(runs)} assistant spans"
        )
    runs = runs[len(runs) - len(sample.turns) :]  # earlier ones are assistant messages of the prompt
    total = sum(
        drift(sample.tokens[t.output_start : t.output_end], encoded.ids[a:b]) for t, (a, b) in zip(sample.turns, runs)
    )
    sample.metadata["retokenize_drift_tokens"] = total
    if as_concat:
        _become(sample, encoded, runs)
    return total


def _become(sample: Sample, encoded, runs: list[tuple[int, int]]) -> None:
    """The sample is the render: prompt = the tokens it shares with the first context (up to the
    first turn's span), the mask on the turns' spans only, no rollout log-probs."""
    ids = encoded.ids
    shared = next(
        (i for i, (a, b) in enumerate(zip(ids, sample.tokens[: sample.prompt_length])) if a != b),
        min(len(ids), sample.prompt_length),
    )
    prompt_length = min(shared, runs[0][0])
    mask = [0] * len(ids)
    for a, b in runs:
        mask[a:b] = [1] * (b - a)
    sample.tokens = list(ids)
    sample.response_length = len(ids) - prompt_length
    sample.loss_mask = mask[prompt_length:]
    sample.rollout_log_probs = None
    sample.token_versions = None
    for k, (turn, (a, b)) in enumerate(zip(sample.turns, runs)):
        turn.output_start, turn.output_end = a, b
        turn.observation_end = runs[k + 1][0] if k + 1 < len(runs) else len(ids)
        turn.context_ids = turn.image_indices = None
    if encoded.tensors:
        sample.multimodal_train_inputs = dict(encoded.tensors)
