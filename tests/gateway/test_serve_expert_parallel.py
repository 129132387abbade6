"""`ft serve --ranks 2`: the experts of `tiny` split over two gloo processes (rank 0 serving and
mirroring every engine call, `engine.parallel_worker`) answer greedily as one process does, a
turn that continues a conversation included, with the attention and DeltaNet layers split by heads
(--split heads) or chosen by timing both at warm-up (the default, logged); SIGTERM ends both
processes cleanly."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from engine.parallel import ExpertParallel
from gateway.embedded import serve_process
from gateway.serve import config_from_args
from gateway.serve_prepare import expert_parallel
from tests.conftest import serve_args

SYSTEM = "You are terse. " * 40
TURNS = [
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"},
     {"role": "assistant", "content": "hi"}, {"role": "user", "content": "and then?"}],
]


def answers(url: str) -> list[dict]:
    out = []
    for messages in TURNS:
        r = httpx.post(url + "/v1/chat/completions", timeout=120,
                       json={"model": "tiny", "max_tokens": 12, "temperature": 0, "messages": messages})
        assert r.status_code == 200, r.text
        out.append({"choice": r.json()["choices"][0], "usage": r.json()["usage"]})
    return out


def children(proc: subprocess.Popen) -> list[int]:
    return [int(pid) for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]


def test_two_ranks_answer_as_one_process_and_stop_on_sigterm():
    proc, url = serve_process(["--preset", "tiny"])
    try:
        single = answers(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    for split in ("auto", "heads"):
        proc, url = serve_process(["--preset", "tiny", "--ranks", "2", "--split", split])
        try:
            followers = children(proc)
            assert len(followers) == 1
            assert answers(url) == single
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(60)
        log = proc.stdout.read() if proc.stdout else ""
        assert code == 0, log
        layers = "split by heads" if split == "heads" else ""  # auto: whichever was faster
        assert f"attention and DeltaNet layers {layers}" in log and ("at warm-up" in log) == (split == "auto"), log
        assert not any(Path(f"/proc/{pid}").exists() for pid in followers)  # reaped by rank 0 before it left


def test_the_flags_give_rank_0_its_config_and_refuse_what_they_cannot_run_with():
    on_cpu = serve_args("--ranks", "4")
    expert_parallel(on_cpu)
    assert config_from_args(on_cpu).engine.expert_parallel == ExpertParallel(0, 4)
    on_gpus = serve_args("--gpus", "2,3")
    expert_parallel(on_gpus)
    config = config_from_args(on_gpus).engine
    assert (config.device, config.expert_parallel) == ("cuda:2", ExpertParallel(0, 2))
    assert config_from_args(serve_args()).engine.expert_parallel is None
    assert config_from_args(serve_args("--ranks", "2", "--split", "heads")).engine.head_split
    assert not config_from_args(serve_args("--ranks", "2")).engine.head_split  # auto: chosen at warm-up
    for argv in (["--gpus", "0"], ["--gpus", "0,0"], ["--gpus", "0,1", "--ranks", "2"], ["--ranks", "1"]):
        with pytest.raises(SystemExit):
            serve_args(*argv)
    for argv, problem in ((["--ranks", "2", "--device", "cuda"], "--ranks: processes on the CPU"),
                          (["--gpus", "0,1", "--gpu-memory", "20"], "--gpus: the memory plan is for one device"),
                          (["--split", "heads"], "--split heads: the heads are split over the ranks")):
        with pytest.raises(ValueError, match=problem):
            expert_parallel(serve_args(*argv))
