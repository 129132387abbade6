"""Pins and demotion on the real server (tiny preset, loopback port, teacher-forced outputs), the pins'
clock injected so no test sleeps: an answer that ends in a tool call keeps its session's state pinned
while the tool runs; a live request that needs the memory breaks the pin (counted in /metrics), and
the state is then found one tier down; a tool that outlives its TTL finds its state one tier down,
never lost; a live sequence dropped after the store lost its records stores them first."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway.embedded import serve_in_thread
from gateway.pins import PinConfig
from gateway.service import ServeConfig
from tests.gateway.test_server_anchors import TOOLS, assistant_turn, tokens, tool_round


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def expire(runtime, clock: Clock, seconds: float) -> None:
    """`seconds` pass: the retention sweep demotes the states of the pins that ran out, and its moves finish."""
    clock.now += seconds
    for job in runtime.retention.sweep():
        job.result(timeout=60)


def pin_metrics(client) -> tuple[int, dict[str, int]]:
    """`ft_pins_active` and `ft_pins_broken_total` by tier, as /metrics exposes them."""
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    active = int(families["ft_pins_active"].samples[0].value)
    broken = {s.labels["tier"]: int(s.value) for s in families["ft_pins_broken"].samples
              if s.name == "ft_pins_broken_total"}
    return active, broken


class Session:
    """An agent's tool loop: each request's answer is a teacher-forced call of `bash`."""

    def __init__(self, server, name: str, clock: Clock | None = None, tool_s: float = 10.0):
        self.server, self.name, self.turn, self.clock, self.tool_s = server, name, 0, clock, tool_s
        self.messages = [{"role": "system", "content": f"You are agent {name}. " * 30},
                         {"role": "user", "content": f"Fix the tests of project {name}."}]

    def body(self) -> dict:
        """The next request's body."""
        forced = tool_round(f"pytest {self.name} -k {self.turn}")
        return {"model": "tiny", "messages": self.messages, "tools": TOOLS, "ft_forced_output": forced}

    def step(self) -> tuple[int, str]:
        """One request: its tokens restored and why the rest was prefilled (`x-prefill-reasons`). Its answer
        and the tool's result join the history."""
        body = self.body()
        forced = body["ft_forced_output"]
        with self.server.client() as c:
            r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        response = r.json()
        call = response["choices"][0]["message"]["tool_calls"][0]
        self.messages += [assistant_turn(response, forced["reasoning"]),
                          {"role": "tool", "tool_call_id": call["id"], "content": f"{self.turn} tests failed"}]
        self.turn += 1
        self.server.wait_idle()
        if self.clock is not None:
            self.clock.now += self.tool_s  # the tool runs
        return int(r.headers["x-cached-tokens"]), r.headers["x-prefill-reasons"]


def pinned_session(server):
    """The server's runtime with a clock of the test's on its pins, and session a after one request, its tool
    now running: its pin held."""
    rt, clock = server.runtime, Clock()
    rt.pins.clock = clock
    a = Session(server, "a")
    a.step()
    (pin,) = rt.pins.held()
    return rt, clock, a, pin


def test_a_pin_yields_to_a_live_request_and_the_state_is_found_in_ram(tmp_path):
    server = serve_in_thread(ServeConfig(preset="tiny", live_sequences=1))
    try:
        rt, clock = server.runtime, Clock()
        rt.pins.clock = clock
        a, b = Session(server, "a", clock), Session(server, "b", clock)
        a.step()
        with server.client() as c:
            assert pin_metrics(c) == (1, {"device": 0, "ram": 0})
        b.step()  # b's answer needs the one live slot a holds: a's pin yields
        with server.client() as c:
            assert pin_metrics(c) == (2, {"device": 1, "ram": 0})
        continued = tokens(rt.metrics, "continued")
        restored, reasons = a.step()
        assert restored > 0 and reasons.startswith("new=") and "," not in reasons  # only the tool's result prefilled
        assert tokens(rt.metrics, "continued") == continued  # not continued in place: restored from RAM
        with server.client() as c:  # a's answer took the slot from b in turn
            assert pin_metrics(c) == (2, {"device": 2, "ram": 0})
    finally:
        server.stop()


def test_a_tool_that_outlives_its_ttl_finds_its_state_one_tier_down(tmp_path):
    server = serve_in_thread(ServeConfig(preset="tiny", live_sequences=2, pins=PinConfig(ttl_default_s=60.0)))
    try:
        rt, clock, a, pin = pinned_session(server)
        tip = pin.tip
        assert len(rt.live) == 1 and tip in rt.live
        clock.now += 30  # within its TTL: nothing moves
        assert rt.retention.sweep() == []
        expire(rt, clock, 31)
        assert tip not in rt.live  # demoted from the device...
        assert rt.store.state_tier(tip) == "ram"  # ...to RAM
        with server.client() as c:
            assert pin_metrics(c) == (0, {"device": 0, "ram": 0})  # expired, not broken
        continued = tokens(rt.metrics, "continued")
        restored, reasons = a.step()
        assert restored > 0 and reasons.startswith("new=") and "," not in reasons  # never lost
        assert tokens(rt.metrics, "continued") == continued
        assert rt.pins.ttl(pin.session) == 61  # its next pin lasts the tool time it observed
        (again,) = rt.pins.held()
        assert again.session == pin.session and again.deadline == clock.now + 61
    finally:
        server.stop()


def test_a_live_sequence_dropped_after_the_store_lost_its_records_stores_them_first(monkeypatch):
    """Every store put of a's first request fails (a lost checkpoint is a later miss, never a failed answer),
    so only its live sequence holds its state; when b's answer takes the one live slot, a's sequence stores
    its records (`Checkpoints.spill`) instead of vanishing, and a's next request restores them."""
    server = serve_in_thread(ServeConfig(preset="tiny", live_sequences=1, pins=PinConfig(ttl_max_s=0)))
    try:
        rt = server.runtime
        a, b = Session(server, "a"), Session(server, "b")
        put = rt.store.put

        def failing(*args):
            raise OSError("the disk is gone")

        monkeypatch.setattr(rt.store, "put", failing)
        a.step()
        monkeypatch.setattr(rt.store, "put", put)
        assert rt.store.stats().write_errors > 0 and rt.store.stats().ram_records == 0
        b.step()
        restored, reasons = a.step()
        assert restored > 0 and reasons.startswith("new=") and "," not in reasons
    finally:
        server.stop()


def test_a_tool_that_outlives_its_ttl_finds_its_state_on_disk_once_ram_needs_the_room(tmp_path):
    """Device, then RAM, then disk: a's pin runs out (its live sequence goes down to RAM, its record is
    unpinned), then other sessions' checkpoints fill the small RAM tier and a's state goes down to the disk
    tier (the real LMDB), never lost: a's next request restores it from disk."""
    config = ServeConfig(preset="tiny", live_sequences=1, ram_cache_gib=0.5 / 1024, disk_cache=tmp_path,
                         disk_cache_gib=1.0, pins=PinConfig(ttl_default_s=60.0))
    server = serve_in_thread(config)
    try:
        rt, clock, a, pin = pinned_session(server)
        expire(rt, clock, 61)
        assert pin.tip not in rt.live and rt.store.state_tier(pin.tip) == "ram"
        others = [Session(server, name) for name in "bcd"]
        for other in others:
            other.step()
            expire(rt, clock, 61)
        assert rt.store.stats().ram_evictions > 0
        assert rt.store.state_tier(pin.tip) == "disk"  # down a tier, not dropped
        disk_hits = rt.store.stats().disk_hits
        restored, reasons = a.step()
        assert restored > 0 and reasons.startswith("new=") and "," not in reasons  # only the tool's result
        assert rt.store.stats().disk_hits > disk_hits
    finally:
        server.stop()
