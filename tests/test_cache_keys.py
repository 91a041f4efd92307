"""Cache and routing keys: stable, bound to every part, unambiguous, domain-separated."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache.keys import cache_key, canonical_params, content_key, params_of, route_key
from tests.server_process import REPO

PARAMS = {"min_pixels": 3136, "max_pixels": 1003520, "patch_size": 14, "merge_size": 2,
          "mean": [0.48145466, 0.4578275, 0.40821073], "std": [0.26862954, 0.26130258, 0.27577711]}
URL = "https://example.com/cat.jpg"
# Pinned: a change here invalidates every cache arena and moves every key on the ring.
PINNED = {
    "uuid": "u:0cb87ddc51beca74d5e667786dc2f1db",
    "url": "h:cc2996303390520f1afe7a3064a25b83",
    "inline": "b:c3b191765ca177ee8e11ca964a1ccb25",
    "content": "ec5d202db1203b5346a6f64f20c08e7e3aa02a09bfdf2cd5c082b31c8dc01104",
    "cache": "5cc0e31aade3169040e7c4d5cd9b18702b78ac80973b7fcbc6815940b13afabe",
}


def _all_keys() -> dict[str, str]:
    return {"uuid": route_key(uuid="abc"), "url": route_key(url=URL), "inline": route_key(inline=b"\xff\xd8"),
            "content": content_key(b"hello", PARAMS, "fp-1"), "cache": cache_key(route_key(url=URL), PARAMS, "fp-1")}


def test_pinned_values() -> None:
    assert _all_keys() == PINNED


def test_stable_in_a_fresh_process() -> None:
    code = "from tests.test_cache_keys import _all_keys; print(sorted(_all_keys().items()))"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == str(sorted(PINNED.items()))


def test_content_key_is_the_documented_construction() -> None:
    h = hashlib.blake2b(digest_size=32)
    for part in (b"mmenc/content/v1", b"hello", canonical_params(PARAMS), b"fp-1"):
        h.update(len(part).to_bytes(8, "big") + part)
    assert content_key(b"hello", PARAMS, "fp-1") == h.hexdigest()


def test_route_key_precedence_and_format() -> None:
    assert route_key(uuid="abc", url=URL, inline=b"x") == route_key(uuid="abc")
    assert route_key(url=URL, inline=b"x") == route_key(url=URL)
    assert route_key(uuid=None, url=None, inline=b"").startswith("b:")  # empty inline bytes still get a key
    for key in (route_key(uuid="abc"), route_key(url=URL), route_key(inline=b"x")):
        assert len(key) == 2 + 32 and int(key[2:], 16) >= 0
    with pytest.raises(ValueError):
        route_key()
    with pytest.raises(ValueError):
        route_key(uuid="", url="")


def test_route_kinds_never_collide_on_the_same_text() -> None:
    text = "https://example.com/cat.jpg"
    keys = {route_key(uuid=text), route_key(url=text), route_key(inline=text.encode())}
    assert len(keys) == 3
    assert {k[:2] for k in keys} == {"u:", "h:", "b:"}


def test_every_part_changes_the_key() -> None:
    base_content, base_cache = content_key(b"hello", PARAMS, "fp-1"), cache_key("h:00", PARAMS, "fp-1")
    assert content_key(b"hellp", PARAMS, "fp-1") != base_content
    assert content_key(b"hello", PARAMS, "fp-2") != base_content
    assert cache_key("h:01", PARAMS, "fp-1") != base_cache
    assert cache_key("h:00", PARAMS, "fp-2") != base_cache
    for name, value in PARAMS.items():
        changed = {**PARAMS, name: [*value[:2], value[2] + 1e-6] if isinstance(value, list) else value + 1}
        assert content_key(b"hello", changed, "fp-1") != base_content, name
        assert cache_key("h:00", changed, "fp-1") != base_cache, name
        dropped = {k: v for k, v in PARAMS.items() if k != name}
        assert content_key(b"hello", dropped, "fp-1") != base_content, name


def test_param_order_and_containers_do_not_matter() -> None:
    reordered = dict(reversed(list(PARAMS.items())))
    as_tuples = {k: tuple(v) if isinstance(v, list) else v for k, v in PARAMS.items()}
    as_numpy = {**PARAMS, "mean": np.array(PARAMS["mean"]), "patch_size": np.int64(14)}
    key = content_key(b"hello", PARAMS, "fp-1")
    assert content_key(b"hello", reordered, "fp-1") == key
    assert content_key(b"hello", as_tuples, "fp-1") == key
    assert content_key(b"hello", as_numpy, "fp-1") == key
    assert content_key(memoryview(b"hello"), PARAMS, "fp-1") == key
    assert content_key(bytearray(b"hello"), PARAMS, "fp-1") == key


def test_no_concatenation_ambiguity() -> None:
    assert content_key(b"ab", {}, "c") != content_key(b"a", {}, "bc")
    assert content_key(b"a{}", {}, "") != content_key(b"a", {}, "{}")
    assert cache_key("ab", {}, "c") != cache_key("a", {}, "bc")
    assert content_key(b"x", {"a": "b,c"}, "") != content_key(b"x", {"a": "b", "c": ""}, "")


def test_content_and_cache_keys_are_domain_separated() -> None:
    route = "h:" + "0" * 32
    assert content_key(route.encode(), PARAMS, "fp") != cache_key(route, PARAMS, "fp")


def test_params_must_be_json_values() -> None:
    with pytest.raises(TypeError):
        content_key(b"x", {"f": object()}, "fp")
    with pytest.raises(TypeError):
        content_key(b"x", {1: 2}, "fp")  # type: ignore[dict-item]
    with pytest.raises(ValueError):
        content_key(b"x", {"f": float("nan")}, "fp")
    with pytest.raises(ValueError):
        cache_key("", PARAMS, "fp")


def test_params_of_picks_fields_from_a_dataclass() -> None:
    @dataclass(frozen=True)
    class Cfg:
        min_pixels: int = 1
        image_mean: tuple[float, ...] = (0.5, 0.5)
        decode_backend: str = "auto"

    assert params_of(Cfg(), ["min_pixels", "image_mean"]) == {"min_pixels": 1, "image_mean": [0.5, 0.5]}
    with pytest.raises(AttributeError):
        params_of(Cfg(), ["max_pixels"])


_param_values = st.one_of(st.integers(-5, 5), st.floats(-2, 2, allow_nan=False), st.text(max_size=3),
                          st.lists(st.integers(0, 3), max_size=3))
_params = st.dictionaries(st.text(max_size=3), _param_values, max_size=3)
_parts = st.tuples(st.binary(max_size=6), _params, st.text(max_size=4))


@given(_parts, _parts)
def test_different_inputs_give_different_keys(a: tuple, b: tuple) -> None:
    same = a[0] == b[0] and canonical_params(a[1]) == canonical_params(b[1]) and a[2] == b[2]
    assert (content_key(*a) == content_key(*b)) == same
    route_a, route_b = a[0].hex() or "-", b[0].hex() or "-"
    assert (cache_key(route_a, a[1], a[2]) == cache_key(route_b, b[1], b[2])) == (same and route_a == route_b)


@given(st.text(min_size=1, max_size=8), st.text(min_size=1, max_size=8))
def test_different_route_sources_give_different_keys(a: str, b: str) -> None:
    assert (route_key(url=a) == route_key(url=b)) == (a == b)
    assert (route_key(uuid=a) == route_key(uuid=b)) == (a == b)
    assert route_key(uuid=a) != route_key(url=b)
    assert route_key(url=a) != route_key(inline=b.encode())
