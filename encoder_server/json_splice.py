"""JSON bodies with large embeddings written piecewise.

`json.dumps` scans every character of a string for escapes, and the string itself is a `str` copy of the
base64 bytes: for one qwen2.5-vl-7b image embedding (725 tokens x 3584 floats, 13.9 MB of base64) that is
~70 ms of the gateway's single event loop on this 2-core machine (`mmenc bench response`). Base64 text
needs no JSON escaping, so the response is dumped with short placeholders where those strings go, and
their bytes are joined in.

Float arrays (`encoding_format: "float"`) are worse: `json.dumps(array.tolist())` of the same embedding
holds the event loop (and the GIL, so a thread would not help) for ~1.4 s. `pieces` formats them a block of
rows at a time and marks the points between blocks, where the gateway writes what it has and lets other
requests run; the text is byte-for-byte what `json.dumps(..., separators=(",", ":"))` gives.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

BLOCK_VALUES = 1 << 15  # floats formatted between two yield points (~15 ms here)


@dataclass(frozen=True)
class Base64Bytes:
    """A JSON string value given as its base64 bytes (alphabet A-Z a-z 0-9 + / =: nothing to escape)."""

    data: bytes


@dataclass(frozen=True)
class FloatArray:
    """A JSON array of numbers (nested lists for 2-D), as `json.dumps(array.tolist())` writes it."""

    array: np.ndarray


def pieces(obj: Any) -> Iterator[bytes | None]:
    """The compact JSON text of `obj` in pieces, `Base64Bytes` as strings and `FloatArray` as number arrays;
    a None between pieces marks where a caller may yield to its event loop."""
    tag = secrets.token_hex(8)  # placeholders no other string in `obj` can equal by accident
    values: list[Base64Bytes | FloatArray] = []

    def swap(value: Any) -> Any:
        if isinstance(value, Base64Bytes | FloatArray):
            values.append(value)
            return f"@{tag}@{len(values) - 1}"
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [swap(v) for v in value]
        return value

    text = json.dumps(swap(obj), separators=(",", ":"))
    parts = re.split(f'"@{tag}@([0-9]+)"', text)  # text, index, text, index, ..., text
    yield parts[0].encode()
    for index, after in zip(parts[1::2], parts[2::2], strict=True):
        value = values[int(index)]
        if isinstance(value, Base64Bytes):
            yield b'"' + value.data + b'"'
        else:
            yield from _numbers(value.array)
        yield after.encode()


def dumps(obj: Any) -> bytes:
    """All of `pieces(obj)` as one bytes object."""
    return b"".join(p for p in pieces(obj) if p is not None)


def _numbers(array: np.ndarray) -> Iterator[bytes | None]:
    if array.ndim not in (1, 2):
        yield json.dumps(array.tolist(), separators=(",", ":")).encode()
        return
    rows = array if array.ndim == 2 else array.reshape(-1, 1)
    per_block = max(1, BLOCK_VALUES // max(1, rows.shape[1]))
    yield b"["
    for start in range(0, rows.shape[0], per_block):
        block = array[start:start + per_block].tolist()  # 1-D: numbers; 2-D: rows
        text = json.dumps(block, separators=(",", ":"))[1:-1]
        yield ("," + text if start else text).encode()
        yield None
    yield b"]"
