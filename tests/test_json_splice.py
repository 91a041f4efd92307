"""json_splice.dumps equals json.dumps with the base64 strings in place, whatever the nesting."""

from __future__ import annotations

import base64
import json

import numpy as np

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
