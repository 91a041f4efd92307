"""Cache and routing keys: blake2b over length-prefixed, domain-tagged parts.

Three kinds of key, never equal to one another:
- route key (`route_key`): known before any download, picks the worker on the ring. `u:` + hash of the
  client's uuid, else `h:` + hash of the URL, else `b:` + hash of the inline bytes.
- cache key (`cache_key`): a route key bound to the preprocessing params and the encoder fingerprint;
  the cache entry looked up before the bytes are known.
- content key (`content_key`): hash of the media bytes bound to the same params and fingerprint.

Every part goes into the hash as `len (8 bytes, big-endian) || bytes` after a per-kind domain tag, so
no two different part lists hash the same input (`("ab", "c")` vs `("a", "bc")`). Params are encoded as
canonical JSON (sorted keys, no whitespace, tuples as lists). Keys are lower-case hex and stable across
processes, runs and machines (no Python `hash()`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

Buffer = bytes | bytearray | memoryview

ROUTE_DIGEST_BYTES = 16  # 32 hex chars: routing plus the pre-download cache lookup
KEY_DIGEST_BYTES = 32  # 64 hex chars: cache entries (a collision would serve another media's embedding)

_ROUTE_TAGS = {"u": b"mmenc/route/uuid/v1", "h": b"mmenc/route/url/v1", "b": b"mmenc/route/inline/v1"}
_CONTENT_TAG = b"mmenc/content/v1"
_CACHE_TAG = b"mmenc/cache/v1"


def _digest(tag: bytes, parts: Sequence[Buffer], digest_size: int) -> str:
    """Hex blake2b of `tag` and `parts`, each length-prefixed (no concatenation ambiguity)."""
    h = hashlib.blake2b(digest_size=digest_size)
    for part in (tag, *parts):
        size = part.nbytes if isinstance(part, memoryview) else len(part)
        h.update(size.to_bytes(8, "big"))
        h.update(part)
    return h.hexdigest()


def _jsonable(value: Any) -> Any:
    """JSON fallback for numpy/torch scalars and arrays (`tolist()`) and dataclasses; anything else is an error."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"cache key params must be JSON values, got {type(value).__name__}")


def canonical_params(params: Mapping[str, object]) -> bytes:
    """Canonical JSON of `params`: sorted keys, compact separators, ASCII, no NaN/Infinity.

    NOTE: `1` and `1.0` encode differently; a caller that changes a value's type gets a different key
    (a miss, never a wrong hit). Keys must be strings so `{1: x}` and `{"1": x}` cannot be confused.
    """
    if not all(isinstance(k, str) for k in params):
        raise TypeError("cache key params need string keys")
    text = json.dumps(dict(params), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False,
                      default=_jsonable)
    return text.encode("ascii")


def route_key(uuid: str | None = None, url: str | None = None, inline: Buffer | None = None) -> str:
    """The key that routes an item to a worker, computable before any download.

    Args:
        uuid: the client's own media id; wins when given (non-empty).
        url: the media URL (or allowed local path); used when there is no uuid.
        inline: the media bytes of a `data:` URI; used when there is neither (may be empty).

    Returns:
        `"u:" | "h:" | "b:"` + 32 hex chars. The tag names the source, so the three never collide.

    Raises:
        ValueError: when none of the three is given.
    """
    if uuid:
        return "u:" + _digest(_ROUTE_TAGS["u"], [uuid.encode("utf-8")], ROUTE_DIGEST_BYTES)
    if url:
        return "h:" + _digest(_ROUTE_TAGS["h"], [url.encode("utf-8")], ROUTE_DIGEST_BYTES)
    if inline is not None:
        return "b:" + _digest(_ROUTE_TAGS["b"], [inline], ROUTE_DIGEST_BYTES)
    raise ValueError("route_key needs a uuid, a url or inline bytes")


def content_key(media: Buffer, params: Mapping[str, object], fingerprint: str) -> str:
    """Cache key of encoded media: blake2b-256 of (media bytes, canonical params, encoder fingerprint).

    Args:
        media: the media bytes (or a digest of them that the caller computed, e.g. in a fetch process).
        params: the preprocessing parameters that change the output (see `params_of`).
        fingerprint: identifies the encoder weights/config; a new model never hits an old entry.

    Returns:
        64 hex chars.
    """
    return _digest(_CONTENT_TAG, [media, canonical_params(params), fingerprint.encode("utf-8")], KEY_DIGEST_BYTES)


def cache_key(route: str, params: Mapping[str, object], fingerprint: str) -> str:
    """Cache key under a route key (uuid / URL / inline hash), for lookups before the bytes are known.

    Same params/fingerprint binding as `content_key` under a different domain tag, so a cache key never
    equals a content key. Returns 64 hex chars.
    """
    if not route:
        raise ValueError("cache_key needs a route key")
    parts = [route.encode("utf-8"), canonical_params(params), fingerprint.encode("utf-8")]
    return _digest(_CACHE_TAG, parts, KEY_DIGEST_BYTES)


def params_of(cfg: object, fields: Sequence[str]) -> dict[str, Any]:
    """`{field: getattr(cfg, field)}` for the named fields of a (dataclass) config; tuples become lists.

    Raises:
        AttributeError: when `cfg` lacks one of `fields` (a typo must not silently drop a key part).
    """
    out: dict[str, Any] = {}
    for name in fields:
        value = getattr(cfg, name)
        out[name] = list(value) if isinstance(value, tuple) else value
    return out
