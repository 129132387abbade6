from __future__ import annotations

import torch

from engine import SamplingParams


def test_decode_continuation_matches_full_prefill_at_each_step(tiny):
    prompt = list(range(500, 560))
    state = tiny.new_state()
    logits = tiny.prefill(state, prompt).logits
    events = list(tiny.generate(state, logits, SamplingParams(max_tokens=12)))
    generated = [e.token_id for e in events]
    full = tiny.prefill(tiny.new_state(), prompt + generated, all_logits=True).logits
    for i, token in enumerate(generated):
        assert token == int(torch.argmax(full[len(prompt) - 1 + i]))
    # step logits equal too: feed the generated tokens one decode step at a time
    state = tiny.new_state()
    tiny.prefill(state, prompt)
    stepped = tiny.feed(state, generated)
    assert (stepped - full[len(prompt) :]).abs().max().item() <= 1e-4


def test_max_tokens_and_stop_tokens(tiny):
    prompt = list(range(100, 130))
    state = tiny.new_state()
    logits = tiny.prefill(state, prompt).logits
    events = list(tiny.generate(state, logits, SamplingParams(max_tokens=5)))
    assert len(events) == 5 and events[-1].finish_reason == "length"
    assert all(e.finish_reason is None for e in events[:-1])
    stop_at = events[2].token_id
    state = tiny.new_state()
    logits = tiny.prefill(state, prompt).logits
    stopped = list(tiny.generate(state, logits, SamplingParams(max_tokens=5, stop_token_ids=frozenset({stop_at}))))
    first = next(i for i, e in enumerate(events) if e.token_id == stop_at)
    assert len(stopped) == first + 1 and stopped[-1].finish_reason == "stop"


def _sample(tiny, **kw):
    state = tiny.new_state()
    logits = tiny.prefill(state, list(range(300, 320))).logits
    return [e.token_id for e in tiny.generate(state, logits, SamplingParams(max_tokens=8, **kw))]


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(tiny):
    a = _sample(tiny, temperature=1.5, seed=7)
    assert a == _sample(tiny, temperature=1.5, seed=7)
    assert a != _sample(tiny, temperature=1.5, seed=8) or a != _sample(tiny)


def test_top_k_one_is_greedy(tiny):
    assert _sample(tiny, temperature=1.0, top_k=1, seed=3) == _sample(tiny)


def test_tiny_top_p_is_greedy(tiny):
    assert _sample(tiny, temperature=1.0, top_p=1e-6, seed=3) == _sample(tiny)


def test_ids_past_the_tokenizer_are_never_chosen():
    from engine.sampling import Sampler

    logits = torch.zeros(300)
    logits[250:] = 50.0  # the model's padding rows past the tokenizer's vocabulary
    for params in (SamplingParams(vocab_limit=200), SamplingParams(temperature=1.0, seed=1, vocab_limit=200)):
        sampler = Sampler(params, torch.device("cpu"))
        assert all(sampler(logits) < 200 for _ in range(50))
