"""Batched = solo: sequences run together in one forward per step (prefill chunks mixed with
decode tokens, joining and leaving at any step) give each one's solo logits (fp32, 1e-4)."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Engine, Feed

TOL = 1e-4
SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def sequences(draw):
    """Per sequence: prompt, tokens fed after it, the step it joins at, where it is restored from
    (0: a fresh state), capture points in its prompt, after how many fed tokens it leaves, and
    whether its fed tokens are teacher-forced in one feed (`--forced-decode prefill`) rather than
    decoded one a step."""
    out = []
    for _ in range(draw(st.integers(2, 5))):
        length = draw(st.integers(2, 70))
        prompt = draw(st.lists(st.integers(0, 248_000), min_size=length, max_size=length))
        fed = draw(st.lists(st.integers(0, 248_000), min_size=1, max_size=6))
        restore_at = draw(st.sampled_from([0, 0, draw(st.integers(1, length - 1))]))
        captures = draw(st.lists(st.integers(restore_at + 1, length), max_size=3, unique=True))
        leaves = draw(st.integers(1, len(fed)))  # < len(fed): cancelled mid-batch
        out.append(dict(prompt=prompt, fed=fed[:leaves], join=draw(st.integers(0, 6)), restore_at=restore_at,
                        captures=sorted(captures), forced=leaves > 2 and draw(st.booleans())))
    return out


def solo(engine, seq) -> list[torch.Tensor]:
    """The logits after the prompt, then after each fed token (a forced sequence: after the last),
    the sequence alone, decoding them one by one."""
    state = engine.new_state()
    logits = [engine.prefill(state, seq["prompt"]).logits]
    logits += [engine.decode(state, t) for t in seq["fed"][:-1]]
    return [logits[0], logits[-1]] if seq["forced"] else logits


def results(seq) -> int:
    """How many logits a sequence gives: after its prompt and each fed token, or after its prompt
    and its forced feed."""
    return 2 if seq["forced"] else len(seq["fed"])


def batched(engine, seqs, budget: int) -> list[list[torch.Tensor]]:
    """Every step: all decode tokens, then prefill chunks of the joined sequences within `budget`."""
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    feeds: dict[int, Feed] = {}
    step = 0
    while any(len(out) < results(s) for out, s in zip(logits, seqs, strict=True)):
        for i, s in enumerate(seqs):
            if s["join"] == step:
                state = engine.new_state()
                if s["restore_at"]:
                    cut = s["restore_at"]
                    state = engine.restore(engine.prefill(engine.new_state(), s["prompt"][:cut], capture_at=[cut]).snapshots)
                feeds[i] = Feed(state, s["prompt"][state.length :], capture_at=s["captures"])
        parts, left = [], budget
        for feed in feeds.values():
            if not feed.is_prefill:
                parts.append((feed, 1))
            elif left > 0:
                parts.append((feed, min(left, feed.remaining)))
                left -= parts[-1][1]
        if parts:
            engine.step(parts)
        for i, feed in list(feeds.items()):
            if feed.result is None:
                continue
            logits[i].append(feed.result.logits)
            seq = seqs[i]
            assert [s.end for s in feed.result.snapshots] == (seq["captures"] if len(logits[i]) == 1 else [])
            if len(logits[i]) < results(seq):  # the next token, or all the forced ones in one feed
                feeds[i] = Feed(feed.state, seq["fed"][:-1] if seq["forced"] else [seq["fed"][len(logits[i]) - 1]])
            else:
                del feeds[i]  # left the batch (finished, or cancelled before its other tokens)
        step += 1
    return logits


def test_decode_tokens_ride_in_a_prefill_forward(tiny, monkeypatch):
    """A step of three decode tokens and another sequence's prefill chunk (capturing states) is
    one forward (`Mixed`); its logits, captured states and the sequences' next steps are those of
    the decode step and the prefill run apart (the layout of an engine that does not mix)."""

    def run(mixed: bool) -> tuple[list, list[torch.Tensor], list[type]]:
        monkeypatch.setattr(tiny.scheduler, "mixes", mixed)
        states = [tiny.new_state() for _ in range(3)]
        for i, state in enumerate(states):
            tiny.prefill(state, list(range(300 + i, 340 + 9 * i)))
        seen: list[type] = []
        forward = tiny.model.forward
        monkeypatch.setattr(tiny.model, "forward", lambda ids, batch, *a, **k: seen.append(type(batch)) or forward(ids, batch, *a, **k))
        decodes = [Feed(state, [50 + i]) for i, state in enumerate(states)]
        prefill = Feed(tiny.new_state(), list(range(900, 960)), capture_at=[20, 60])
        tiny.step([(decodes[0], 1), (prefill, 60), (decodes[1], 1), (decodes[2], 1)])
        monkeypatch.setattr(tiny.model, "forward", forward)
        logits = [f.result.logits for f in [*decodes, prefill]]
        after = [tiny.decode(f.state, 7) for f in [*decodes, prefill]]
        return prefill.result.snapshots, logits + after, seen

    snapshots, got, seen = run(mixed=True)
    assert [t.__name__ for t in seen] == ["Mixed"]
    want_snapshots, want, seen = run(mixed=False)
    assert [t.__name__ for t in seen] == ["SlotBatch", "Spans"]
    for a, b in zip(got, want, strict=True):
        assert (a - b).abs().max().item() <= TOL
    for a, b in zip(snapshots, want_snapshots, strict=True):
        assert (a.start, a.end, a.tensors.keys()) == (b.start, b.end, b.tensors.keys())
        for name, tensor in a.tensors.items():
            assert (tensor - b.tensors[name]).abs().max().item() <= TOL, name


@SETTINGS
@given(seqs=sequences(), budget=st.integers(1, 96))
def test_batched_steps_give_each_sequence_its_solo_logits(tiny, seqs, budget):
    together = batched(tiny, seqs, budget)
    for seq, got in zip(seqs, together, strict=True):
        want = solo(tiny, seq)
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert (a - b).abs().max().item() <= TOL


def test_decode_tokens_of_several_sequences_share_one_forward(tiny):
    """Four sequences decoded in one step equal four solo decode steps (the batched recurrent step)."""
    prompts = [list(range(100 + i, 120 + 7 * i)) for i in range(4)]
    states = [tiny.new_state() for _ in prompts]
    for state, prompt in zip(states, prompts, strict=True):
        tiny.prefill(state, prompt)
    feeds = [Feed(state, [42 + i]) for i, state in enumerate(states)]
    tiny.step([(f, 1) for f in feeds])
    for i, prompt in enumerate(prompts):
        alone = tiny.new_state()
        tiny.prefill(alone, prompt)
        assert (feeds[i].result.logits - tiny.decode(alone, 42 + i)).abs().max().item() <= TOL
        assert feeds[i].state.length == len(prompt) + 1


@settings(SETTINGS, max_examples=4)
@given(data=st.data())
def test_slots_evicted_and_rebound_keep_every_sequence_exact(preset_dirs, data):
    """Six sequences decoded in random subsets of up to three: the runner has fewer slots than
    sequences, so slots are taken from sequences outside the step (their state copied out) and
    bound again later; prefills and snapshots happen on states that may still share a slot. Every
    logit equals the one-pass prefill's at the same position."""
    tiny = Engine.load(preset_dirs["tiny"])  # its own runner: slots sized by this test's batches
    rng = data.draw(st.randoms(use_true_random=False))
    token = lambda: rng.randrange(248_000)  # noqa: E731
    fed = [[token() for _ in range(rng.randrange(2, 40))] for _ in range(6)]
    states = [tiny.new_state() for _ in fed]
    got = [[(len(f), tiny.prefill(s, f).logits)] for s, f in zip(states, fed, strict=True)]  # (end, logits)
    for _ in range(data.draw(st.integers(4, 10))):
        chosen = rng.sample(range(6), rng.randrange(1, 4))
        if rng.random() < 0.3:  # a prefill on a state that may still use its slot's views
            i = chosen.pop()
            extra = [token() for _ in range(rng.randrange(2, 6))]
            fed[i] += extra
            got[i].append((len(fed[i]), tiny.prefill(states[i], extra).logits))
        feeds = {i: Feed(states[i], [token()]) for i in chosen}
        if feeds:
            tiny.step([(f, 1) for f in feeds.values()])
        for i, feed in feeds.items():
            fed[i] += feed.token_ids
            got[i].append((len(fed[i]), feed.result.logits))
    assert tiny.runner.slots < 6
    for state, tokens, outs in zip(states, fed, got, strict=True):
        assert state.length == len(tokens)
        full = tiny.prefill(tiny.new_state(), tokens, all_logits=True).logits
        for end, logits in outs:
            assert (logits - full[end - 1]).abs().max().item() <= TOL
        tail = [7, 8, 9]  # a snapshot of a slot-bound state restores to the same continuation
        restored = tiny.restore(tiny.snapshot(state, 0))
        assert (tiny.prefill(restored, tail).logits - tiny.prefill(state, tail).logits).abs().max().item() <= TOL


def test_a_snapshot_survives_its_slot_going_to_another_sequence(preset_dirs):
    """KV deltas taken of a sequence while it holds a decode slot keep their values after the slot
    is bound to other sequences (the checkpoint store may take them later, on its own thread)."""
    tiny = Engine.load(preset_dirs["tiny"])
    tiny.runner.warmup(1)  # one slot: every other sequence takes it
    state = tiny.new_state()
    tiny.prefill(state, list(range(100, 140)))
    tiny.decode(state, 7)  # now bound to the slot
    delta = tiny.kv_delta(state, 0, state.length)
    before = {name: t.clone() for name, t in delta.tensors.items()}
    other = tiny.new_state()
    tiny.prefill(other, list(range(500, 560)))
    tiny.decode(other, 9)  # takes the slot, overwriting its rows
    assert all(torch.equal(delta.tensors[name], t) for name, t in before.items())


@settings(SETTINGS, max_examples=6)
@given(seqs=sequences(), budget=st.integers(1, 96))
def test_short_prefills_on_slots_give_each_sequence_its_solo_logits(preset_dirs, tiny, seqs, budget):
    """The batched steps again, with every short last chunk of a prefill run on its sequence's
    slot, padded to a token bucket (the path a GPU replays as a graph), against solo runs of the
    span forward: padding changes no state, and captures at a prefill's end are the same."""
    slotted = Engine.load(preset_dirs["tiny"], dtype=torch.float32)
    slotted.scheduler.slot_prefill = True
    together = batched(slotted, seqs, budget)
    for seq, got in zip(seqs, together, strict=True):
        want = solo(tiny, seq)
        for a, b in zip(got, want, strict=True):
            assert (a - b).abs().max().item() <= TOL


@settings(SETTINGS, max_examples=8)
@given(data=st.data())
def test_a_slot_prefill_after_a_restore_equals_the_span_forward(preset_dirs, data):
    """A suffix after a restored prefix (the anchor policy's tool result), with captures at segment
    ends inside it (some with DeltaNet states, some KV only), on the slot path (a replay per piece
    between state captures) and on the span path: the same logits, the same snapshots (KV and
    states), and the same next decode steps; the suffix crosses the slot capacity (buffers grow) and
    may run in several pieces of the largest bucket."""
    engines = [Engine.load(preset_dirs["tiny"], dtype=torch.float32) for _ in range(2)]
    engines[1].scheduler.slot_prefill = True
    rng = data.draw(st.randoms(use_true_random=False))
    prefix = [rng.randrange(248_000) for _ in range(data.draw(st.integers(1, 300)))]
    suffix = [rng.randrange(248_000) for _ in range(data.draw(st.integers(1, 1500)))]  # pieces of 512 above 512
    end = len(prefix) + len(suffix)
    captures = data.draw(st.lists(st.integers(len(prefix) + 1, end), max_size=4, unique=True))
    state_at = {p for p in captures if data.draw(st.booleans())}
    outs = []
    for engine in engines:
        base = engine.prefill(engine.new_state(), prefix, capture_at=[len(prefix)]).snapshots
        state = engine.restore(base)
        result = engine.prefill(state, suffix, capture_at=captures, state_at=state_at)
        steps = [engine.decode(state, t) for t in (3, 4)]
        outs.append((result, steps, state.length))
    (a, steps_a, len_a), (b, steps_b, len_b) = outs
    assert len_a == len_b == len(prefix) + len(suffix) + 2
    assert (a.logits - b.logits).abs().max().item() <= TOL
    assert all((x - y).abs().max().item() <= TOL for x, y in zip(steps_a, steps_b, strict=True))
    assert [(s.start, s.end) for s in a.snapshots] == [(s.start, s.end) for s in b.snapshots]
    for sa, sb in zip(a.snapshots, b.snapshots, strict=True):
        assert sa.tensors.keys() == sb.tensors.keys()
        assert all((sa.tensors[k] - sb.tensors[k]).abs().max().item() <= TOL for k in sa.tensors)
