"""`ft serve --step-log MS` (EngineConfig.step_log_ms): the worker logs each step slower than MS with
what it ran and where its time went, and the engine each slow prefill forward; without it, nothing."""

from __future__ import annotations

import logging
import re

import pytest

from engine.engine_config import EngineConfig
from gateway.protocols import chat
from gateway.serve import config_from_args
from gateway.service import ServeConfig, build_service
from tests.conftest import serve_args

STEP = re.compile(
    r"step \d+: (\d+) prefill tokens in 1 parts, 0 decode rows: engine [\d.]+ ms, tasks [\d.]+ ms; "
    r"[\d.]+ ms since the last step"
)
FORWARD = re.compile(r"prefill forward of (\d+) tokens \(1 sequences, (\d+) captures\): [\d.]+ ms \(fit")


@pytest.mark.parametrize("step_log_ms", [0, None])
def test_slow_steps_are_logged_only_when_asked(step_log_ms, caplog):
    rt = build_service(ServeConfig(preset="tiny", engine=EngineConfig(step_log_ms=step_log_ms)))
    try:
        body = {"model": "tiny", "messages": [{"role": "system", "content": "You read logs."},
                                              {"role": "user", "content": "line of the log\n" * 300}]}
        plan = rt.planner.plan(chat.parse_request(body))
        tokens = plan.ends[-1]

        def prefill():
            yield from rt.checkpoints.prefill(rt.engine.new_state(), plan.segments, plan.chain, plan.ends, 0)

        with caplog.at_level(logging.INFO):
            rt.scheduler.start(prefill()).result(timeout=120)
    finally:
        rt.close()
    steps = [int(m[1]) for r in caplog.records if (m := STEP.search(r.getMessage()))]
    forwards = [(int(m[1]), int(m[2])) for r in caplog.records if (m := FORWARD.search(r.getMessage()))]
    if step_log_ms is None:
        assert steps == [] and forwards == []
        return
    assert sum(steps) == tokens and tokens > 1000  # every step of the prompt's prefill, each with its tokens
    assert sum(n for n, _ in forwards) == tokens and sum(c for _, c in forwards) >= 1  # its captures counted


def test_step_log_flag():
    assert config_from_args(serve_args("--step-log", "25")).engine.step_log_ms == 25
    assert config_from_args(serve_args()).engine.step_log_ms is None
    with pytest.raises(SystemExit):
        serve_args("--step-log", "-1")
