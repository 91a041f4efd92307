"""JSON bodies with large base64 strings spliced in as bytes.

`json.dumps` scans every character of a string for escapes, and the string itself is a `str` copy of the
base64 bytes: for one qwen2.5-vl-7b image embedding (725 tokens x 3584 floats, 13.9 MB of base64) that is
~27 ms of the gateway's single event loop on this 2-core machine. Base64 text needs no JSON escaping, so the
response is dumped with short placeholders where those strings go, and their bytes are joined in.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Base64Bytes:
    """A JSON string value given as its base64 bytes (alphabet A-Z a-z 0-9 + / =: nothing to escape)."""

    data: bytes


def dumps(obj: Any) -> bytes:
    """`json.dumps(obj)` as UTF-8 bytes, where every `Base64Bytes` becomes the JSON string of its data."""
    tag = secrets.token_hex(8)  # placeholders no other string in `obj` can equal by accident
    raws: list[bytes] = []

    def swap(value: Any) -> Any:
        if isinstance(value, Base64Bytes):
            raws.append(value.data)
            return f"@{tag}@{len(raws) - 1}"
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [swap(v) for v in value]
        return value

    text = json.dumps(swap(obj), separators=(",", ":"))
    if not raws:
        return text.encode()
    parts = re.split(f'"@{tag}@([0-9]+)"', text)  # text, index, text, index, ..., text
    out = [parts[0].encode()]
    for index, after in zip(parts[1::2], parts[2::2], strict=True):
        out += [b'"', raws[int(index)], b'"', after.encode()]
    return b"".join(out)
