"""json_splice.dumps equals json.dumps with the base64 strings in place, whatever the nesting."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from encoder_server.json_splice import Base64Bytes, dumps


def test_equals_json_dumps_with_the_strings_in_place() -> None:
    arrays = [np.arange(n, dtype="<f4") * 0.5 for n in (0, 1, 7, 1000)]
    raw = [base64.b64encode(a.tobytes()) for a in arrays]
    obj = {"object": "list", "data": [{"index": i, "embedding": Base64Bytes(r), "grid": [1, 2]} for i, r in
                                      enumerate(raw)],
           "model": 'quote " and \\ and \u00e9', "nested": [[Base64Bytes(raw[2])]], "timings_ms": {"total": 1.5}}
    plain = json.loads(json.dumps(obj, default=lambda v: v.data.decode()))
    assert json.loads(dumps(obj)) == plain
    for i, entry in enumerate(json.loads(dumps(obj))["data"]):
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(entry["embedding"]), "<f4"), arrays[i])


def test_a_string_that_looks_like_a_placeholder_is_left_alone() -> None:
    obj = {"a": "@0000000000000000@0", "b": Base64Bytes(b"QUJD")}
    assert json.loads(dumps(obj)) == {"a": "@0000000000000000@0", "b": "QUJD"}
    assert dumps({"x": 1}) == b'{"x":1}'


@pytest.mark.parametrize("shape", [(0,), (5,), (70_000,), (0, 4), (3, 0), (300, 3584), (2, 3, 4)])
def test_float_arrays_are_written_exactly_as_json_dumps_does(shape) -> None:
    from encoder_server.json_splice import FloatArray, pieces

    array = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    obj = {"data": [{"embedding": FloatArray(array), "b": Base64Bytes(b"QUJD")}], "n": 1}
    reference = json.dumps({"data": [{"embedding": array.tolist(), "b": "QUJD"}], "n": 1}, separators=(",", ":"))
    assert dumps(obj) == reference.encode()
    yields = sum(piece is None for piece in pieces(obj))
    if array.size >= 65_536:  # big arrays give the event loop back between blocks of ~32K numbers
        assert yields >= array.size // 40_000
