from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.events import ReasoningDelta, TextDelta
from gateway.parsers.stop import StopMatcher


def run(chunks, stops):
    m = StopMatcher(stops)
    out = []
    for c in chunks:
        out += m.filter([TextDelta(c)])
        if m.hit:
            break
    out += m.flush()
    return "".join(e.text for e in out), m.hit


@given(text=st.text(alphabet="abcXY", max_size=40), stop=st.text(alphabet="abcXY", min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 40), max_size=6))
def test_output_is_the_text_before_the_first_stop_whatever_the_split(text, stop, cuts):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    got, hit = run(chunks, [stop])
    if stop in text:
        assert (got, hit) == (text[: text.index(stop)], stop)
    else:
        assert (got, hit) == (text, None)


def test_reasoning_is_not_subject_to_stop_strings():
    m = StopMatcher(["END"])
    assert m.filter([ReasoningDelta("the END is near")]) == [ReasoningDelta("the END is near")]
    assert m.hit is None
