"""api/json_shape.py: the scan that bounds a JSON text before anything parses it (issue 38 rows 1 and 3). Its
verdict and counts do not depend on how the text is cut into pieces (a body arrives in arbitrary chunks), it
names the top-level field that crossed a bound, and `loads_bounded` never reaches RecursionError."""

from __future__ import annotations

import json

import httpx
import pytest

from pdcluster.worker.api.json_shape import ShapeError, ShapeScanner, loads_bounded

DOC = json.dumps({"a": "x\\\"y\\\\ [{", "b": [1, {"c": "]"}, [], "\u00e9\u4e2d"], "d": {"e": [[2, 3]]}})


def scan(text: bytes, piece: int, **bounds: int) -> ShapeScanner:
    s = ShapeScanner(**bounds)
    for i in range(0, len(text), piece):
        s.feed(text[i:i + piece])
    return s


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 7, 64])
def test_counts_do_not_depend_on_where_the_text_is_cut(piece: int) -> None:
    whole = scan(DOC.encode(), len(DOC.encode()))
    cut = scan(DOC.encode(), piece)
    assert (cut.depth, cut.values, cut.strings, cut.containers, cut.in_string) == \
        (whole.depth, whole.values, whole.strings, whole.containers, whole.in_string) == (0, 13, 8, 7, False)


@pytest.mark.parametrize("piece", [1, 4, 1 << 16])
def test_each_bound_is_refused_with_the_field_that_crossed_it(piece: int) -> None:
    cases = [(b'{"p": 1, "deep": ' + b"[" * 40 + b"]" * 40 + b"}", "nested", {}),
             (b'{"p": 1, "many": [' + b"0," * 100 + b"0]}", "values", {"max_values": 50}),
             (b'{"p": 1, "many": [' + b'"",' * 100 + b'""]}', "strings", {"max_strings": 50}),
             (b'{"p": 1, "many": [' + b"{}," * 100 + b"{}]}", "objects", {"max_containers": 50})]
    for text, what, bounds in cases:
        with pytest.raises(ShapeError) as e:
            scan(text, piece, **bounds)
        assert what in str(e.value) and e.value.field in ("deep", "many"), (what, e.value.field)


def test_brackets_inside_strings_and_escapes_are_not_structure() -> None:
    text = json.dumps({"s": "[" * 100 + '\\"' * 10 + "{" * 100}).encode()
    for piece in (1, 3, len(text)):
        assert scan(text, piece, max_depth=2).depth == 0


def test_loads_bounded_never_recurses() -> None:
    for bomb in ("[" * 100_000, "[" * 3000 + "]" * 3000, '{"a":' * 5000):
        with pytest.raises(ShapeError):
            loads_bounded(bomb)
    assert loads_bounded('{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]}
    with pytest.raises(ValueError):
        loads_bounded("{not json")


def test_a_large_valid_body_is_parsed_off_the_loop_and_checked_the_same(client: httpx.Client) -> None:
    # over api/body.OFF_LOOP_BYTES: parsed on the parse pool, its numbers and strings checked there too
    from pdcluster.worker.api.body import OFF_LOOP_BYTES

    pad = "p" * (OFF_LOOP_BYTES + 1)
    ok = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "ignored": pad})
    assert ok.status_code == 200, ok.text
    bad = client.post("/v1/completions", content=('{"prompt": "a", "ignored": "' + pad + '", "temperature": NaN}').encode(),
                      headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature", bad.text
