"""A real Qwen2 model (transformers weights, the real Qwen tokenizer and chat template) whose weights
are set so that, after the generation prompt, it writes one fixed token sequence: a bigram model.

The single decoder layer adds nothing (its output projections are zero), so the last hidden state is
the last token's embedding: token ``script[k]`` is embedded on its own axis ``k`` and the LM head
maps axis ``k`` to ``script[k + 1]`` with a margin that leaves every other token a log-probability
below -100. Every id in the script is distinct, so the successor of each is one token; the sequence
starts after the generation prompt's last token and ends with ``<|im_end|>``. Any context that ends
with the generation prompt gets the script, at any temperature; other contexts get uniform noise.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

HIDDEN = 64
MARGIN = 40.0  # logit of the scripted successor (x sqrt(HIDDEN) after the final norm)


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


def build(out: Path, tokenizer, script: list[int]) -> None:
    """Write the model to ``out``: after the generation prompt it emits ``script`` (ending with eot)."""
    import transformers

    start = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"][-1]
    chain = [start, *script]
    if len(set(chain)) != len(chain) or len(chain) - 1 > HIDDEN:
        raise ValueError("the script's ids must be distinct (and fewer than the hidden size)")
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
    )
    model = transformers.Qwen2ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        layer = model.model.layers[0]
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        for k, (token, successor) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token, k] = 1.0
            model.lm_head.weight[successor, k] = MARGIN
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "slime_mt_asset.json").write_text(json.dumps({"kind": "scripted", "script": script}))
