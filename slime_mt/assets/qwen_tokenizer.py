"""The real Qwen tokenizer, rebuilt offline from the ``qwen.tiktoken`` BPE ranks file.

The ranks file ships inside Apache-2.0 PyPI wheels (``dashscope``, ``qwen-agent``), installed with
``--no-deps`` and located through package metadata, never imported. Ranks become a byte-level BPE
(vocab: byte-level string -> rank; merges: every split of a token into two tokens, ordered by the
merged token's rank), with Qwen2's pre-tokenizer regex, NFC normalisation and the 26 special tokens
at their real ids 151643..151668.
"""

from __future__ import annotations

import base64
import importlib.metadata
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from slime_mt.errors import AssetError

QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (token, special) at ids 151643 onward, as in Qwen2.5/Qwen3 tokenizers. "special" tokens are
# dropped by skip_special_tokens; tool and think tags are ordinary text there.
SPECIAL_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
FIRST_SPECIAL_ID = 151643

# Where the ranks file sits inside each wheel that ships it.
_RANKS_FILES = [("dashscope", "dashscope/resources/qwen.tiktoken"), ("qwen-agent", "qwen_agent/utils/qwen.tiktoken")]


def find_ranks_file() -> Path:
    """Locate ``qwen.tiktoken`` in an installed wheel without importing the package."""
    tried = []
    for dist_name, rel in _RANKS_FILES:
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            tried.append(f"{dist_name} (not installed)")
            continue
        path = Path(dist.locate_file(rel))
        if path.is_file():
            return path
        tried.append(f"{path} (missing)")
    raise AssetError(
        "qwen.tiktoken not found; install a wheel that ships it: pip install --no-deps dashscope "
        f"(tried: {', '.join(tried)})"
    )


def load_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError as e:
            raise AssetError(f"{path}:{lineno}: not a 'base64 rank' line: {line[:60]!r}") from e
    return ranks


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map used by byte-level BPE."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level vocab and merges equivalent to tiktoken's rank-ordered BPE."""
    table = _byte_to_unicode()

    def to_str(token: bytes) -> str:
        return "".join(table[b] for b in token)

    vocab = {to_str(token): rank for token, rank in ranks.items()}
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return vocab, [(to_str(left), to_str(right)) for *_, left, right in merges]


def build_tokenizer_json(out_dir: Path) -> None:
    """Write ``tokenizer.json`` of the Qwen tokenizer into ``out_dir``."""
    ranks = load_ranks(find_ranks_file())
    if len(ranks) != FIRST_SPECIAL_ID:
        raise AssetError(f"qwen.tiktoken has {len(ranks)} ranks, expected {FIRST_SPECIAL_ID}")
    vocab, merges = vocab_and_merges(ranks)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=True))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([AddedToken(tok, special=special, normalized=False) for tok, special in SPECIAL_TOKENS])
    for offset, (tok, _) in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(tok) != FIRST_SPECIAL_ID + offset:
            raise AssetError(f"{tok} landed at id {tokenizer.token_to_id(tok)}, expected {FIRST_SPECIAL_ID + offset}")
    tokenizer.save(str(out_dir / "tokenizer.json"))
