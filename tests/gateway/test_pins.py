"""Pins on an injected clock, and the live tier that keeps a pinned sequence last: a session's TTL is
the 90th percentile of its own tool times, capped, a default before any is known; a pin ends when
a request restores through its tip (its session then carried on) or its TTL runs out (its tool still
timed when the session comes back); beyond the limit a live request's sequence breaks a pin
(counted), a precompute's does not, and every sequence let go is spilled."""

from __future__ import annotations

import pytest

from engine import Engine
from gateway.live import LiveSequences
from gateway.pins import TTL_FLOOR_S, PinConfig, Pins
from gateway.serve import config_from_args
from tests.conftest import serve_args


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def engine():
    return Engine.from_preset("tiny")


def chain(name: str, n: int = 3) -> list[bytes]:
    return [f"{name}-{i}".encode() for i in range(n)]


def test_a_sessions_ttl_is_the_p90_of_its_own_tool_times_capped():
    clock = Clock()
    pins = Pins(PinConfig(ttl_max_s=300, ttl_default_s=60), clock)
    assert pins.ttl("s") == 60
    history = chain("s")
    for i, tool_s in enumerate([10, 20, 30, 40, 50, 60, 70, 80, 90, 100]):
        pin = pins.pin(history, "s")
        assert pin is not None
        clock.now += tool_s
        session, held = pins.resume([*history, b"tool result"], None)
        assert session == "s" and held is pin  # the answer's pin ends, its session carried on
        history = [*history, f"turn-{i}".encode()]
    assert pins.ttl("s") == 90  # nearest rank: the 9th of 10
    assert pins.ttl("other") == 60
    for _ in range(3):  # tools of 1000 s: the 90th percentile is one of them, above the cap
        pins.pin(history, "s")
        clock.now += 1000
        pins.resume(history, "s")
    assert pins.ttl("s") == 300
    pins.pin(history, "quick")
    pins.resume(history, None)
    assert pins.ttl("quick") == TTL_FLOOR_S  # a tool of no time still leaves its request time to come
    assert Pins(PinConfig(ttl_max_s=0), clock).pin(history, "s") is None  # pins off


def test_a_pin_holds_until_its_ttl_and_its_tool_is_timed_when_the_session_comes_back_late():
    clock = Clock()
    pins = Pins(PinConfig(ttl_default_s=60), clock)
    pin = pins.pin(chain("a"), "a")
    assert pins.holds(pin.tip) and pins.holds_live(pin.tip) and pins.active == 1
    assert pins.next_deadline() == 60
    clock.now = 59
    assert pins.expire() == []
    clock.now = 60
    assert not pins.holds(pin.tip) and pins.active == 0
    assert pins.expire() == [pin] and pins.held() == []
    clock.now = 200
    session, held = pins.resume([*chain("a"), b"result"], None)
    assert session == "a" and held is None  # expired: nothing held, but the session is known
    assert pins.ttl("a") == 200
    session, _ = pins.resume(chain("fresh"), None)
    assert session == chain("fresh")[-1].hex()  # no client id, no pin on its chain: named by it


def test_beyond_the_limit_a_request_breaks_a_pin_a_precompute_does_not(engine):
    clock = Clock()
    pins = Pins(PinConfig(), clock)
    spilled: list[bytes] = []
    live = LiveSequences(2, pins, spill=lambda kept: spilled.append(kept.chain[-1]))

    def keep(name: str, for_request: bool = True, pin: bool = True) -> bytes:
        anchors = chain(name)
        if pin:
            pins.pin(anchors, name)
        live.keep(anchors, [1, 2, 3], engine.new_state(), for_request=for_request)
        return anchors[-1]

    a = keep("a")
    plain = keep("plain", pin=False)
    b = keep("b")  # the unpinned one goes first, though newer than a
    assert spilled == [plain] and a in live and b in live
    precomputed = keep("precomputed", for_request=False, pin=False)
    assert spilled == [plain, precomputed] and pins.broken_live == 0  # background work breaks no pin
    c = keep("c")
    assert spilled == [plain, precomputed, a] and pins.broken_live == 1  # the oldest pin yields
    assert not pins.holds_live(a) and pins.holds(a)  # its record's pin in RAM holds on
    clock.now += 1000  # every pin's TTL has run out: an ordinary sequence again
    keep("d", pin=False)
    assert spilled[-1] == b and pins.broken_live == 1
    assert live.take(c).length == 0 and c not in live
    live.drop(c)  # handed over: nothing to let go
    assert spilled[-1] == b


def test_kept_sequences_yield_memory_to_a_forward_unpinned_first_then_a_broken_pin(engine):
    """`LiveSequences.yield_memory` (the engine's `relieve` under a memory budget: a forward that the
    expert slots cannot make room for takes the kept sequences' device memory, one at a time)."""
    pins = Pins(PinConfig(), Clock())
    spilled: list[bytes] = []
    live = LiveSequences(4, pins, spill=lambda kept: spilled.append(kept.chain[-1]))
    pinned, plain = chain("pinned"), chain("plain")
    pins.pin(pinned, "pinned")
    live.keep(pinned, [1, 2, 3], engine.new_state(), for_request=True)
    live.keep(plain, [1, 2, 3], engine.new_state(), for_request=True)
    assert live.yield_memory() and spilled == [plain[-1]] and pins.broken_live == 0  # the unpinned, though newer
    assert live.yield_memory() and spilled == [plain[-1], pinned[-1]] and pins.broken_live == 1
    assert not live.yield_memory() and len(live) == 0  # none kept: the forward's BudgetError stands


def test_ft_serve_pin_ttl_max_sets_the_cap_and_0_turns_pins_off():
    assert config_from_args(serve_args()).pins == PinConfig()
    assert config_from_args(serve_args("--pin-ttl-max", "120")).pins.ttl_max_s == 120
    assert not config_from_args(serve_args("--pin-ttl-max", "0")).pins.enabled
