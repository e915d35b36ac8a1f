"""Plain data over a pipe, one JSON line a value (standard library only: shipped into each sandbox of a
grading beside its main.py). What crosses between the model's code and the tests is data, never an object
of either side: None, bool, int, float, complex, str, bytes, and lists, tuples, sets, frozensets and dicts
of them. JSON holds lists, str, int, float, bool and None as they are; every other value is an object of
one tagged key: {"t": [...]} a tuple, {"s": [...]} a set, {"f": [...]} a frozenset, {"d": [[k, v], ...]}
a dict, {"b": "<base64>"} bytes, {"c": [re, im]} a complex, {"x": "nan" | "inf" | "-inf"} a float JSON
cannot hold. ``decode`` builds only those types and refuses anything else (``PlainDataError``)."""

import base64
import json
import math

TAGS = {"t": tuple, "s": set, "f": frozenset}
MAX_DEPTH = 100


class PlainDataError(ValueError):
    """A value that is not plain data, or a line that does not decode to one."""


def encode(value, depth: int = 0):
    """``value`` as JSON-ready data. Subclasses of the plain types are taken as their base type, numpy's
    scalars and arrays as their ``item()`` / ``tolist()``; anything else is refused, naming its type."""
    if depth > MAX_DEPTH:
        raise PlainDataError(f"a value nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, str)):
        return value if type(value) in (bool, str, type(None)) else str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        value = float.__float__(value)
        return value if math.isfinite(value) else {"x": repr(value)}
    if isinstance(value, complex):
        return {"c": [encode(value.real, depth + 1), encode(value.imag, depth + 1)]}
    if isinstance(value, (bytes, bytearray)):
        return {"b": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, list):
        return [encode(v, depth + 1) for v in list.__iter__(value)]
    if isinstance(value, dict):
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in dict.items(value)]}
    for tag, kind in TAGS.items():
        if isinstance(value, kind):
            return {tag: [encode(v, depth + 1) for v in kind.__iter__(value)]}
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):  # numpy scalars and arrays
        return encode(value.tolist(), depth + 1)
    raise PlainDataError(f"a {type(value).__name__} value is not plain data")


def decode(data, depth: int = 0):
    """JSON-decoded ``data`` -> the plain value it stands for (only the plain types are ever built)."""
    if depth > MAX_DEPTH:
        raise PlainDataError(f"a value nested deeper than {MAX_DEPTH} levels")
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [decode(v, depth + 1) for v in data]
    if type(data) is not dict or len(data) != 1:
        raise PlainDataError("a value that is not plain data")
    ((tag, inner),) = data.items()
    if tag in TAGS and type(inner) is list:
        return TAGS[tag](decode(v, depth + 1) for v in inner)
    if tag == "d" and type(inner) is list and all(type(p) is list and len(p) == 2 for p in inner):
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in inner}
    if tag == "b" and type(inner) is str:
        return base64.b64decode(inner, validate=True)
    if tag == "c" and type(inner) is list and len(inner) == 2:
        real, imag = (decode(v, depth + 1) for v in inner)
        if type(real) is float and type(imag) is float:
            return complex(real, imag)
    if tag == "x" and inner in ("nan", "inf", "-inf"):
        return float(inner)
    raise PlainDataError(f"a value tagged {tag!r} that is not plain data")


def dumps(message: dict) -> bytes:
    """One message as a JSON line."""
    return json.dumps(message, allow_nan=False, separators=(",", ":")).encode() + b"\n"


def loads(line: bytes) -> dict:
    """One JSON line -> its message (an object), or PlainDataError."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError) as e:
        raise PlainDataError(f"a line that is not JSON: {e}") from None
    if type(message) is not dict:
        raise PlainDataError("a line that is not a JSON object")
    return message
