"""The script the gateway tests' chain model writes (``rollout_helpers.chain_model``, one successor
per token): text spelled in ids that are all distinct, so that each id has a single successor."""

from __future__ import annotations


def segment(tokenizer, text: str, forbidden: set[int], pieces: dict[str, list[int]] | None = None) -> list[int]:
    """Ids that decode to ``text``, every one distinct and none in ``forbidden``: the longest token
    first, backtracking (``pieces`` fixes the split of some substrings, e.g. " ans" + "wer")."""
    special = set(tokenizer.all_special_ids)
    vocab = {tokenizer.decode([i]): i for i in range(len(tokenizer)) if i not in special}
    longest = max(len(t) for t in vocab)
    fixed = pieces or {}
    budget = [200_000]  # search steps: a text with no segmentation fails fast

    def search(position: int, used: set[int]) -> list[int] | None:
        budget[0] -= 1
        if budget[0] < 0:
            return None
        if position == len(text):
            return []
        for piece, ids in fixed.items():
            if text.startswith(piece, position) and not used & set(ids):
                rest = search(position + len(piece), used | set(ids))
                if rest is not None:
                    return list(ids) + rest
        for end in range(min(len(text), position + longest), position, -1):
            token = vocab.get(text[position:end])
            if token is None or token in used:
                continue
            rest = search(end, used | {token})
            if rest is not None:
                return [token, *rest]
        return None

    ids = search(0, set(forbidden))
    if ids is None:
        raise ValueError(f"no segmentation of {text!r} into distinct tokens")
    return ids
