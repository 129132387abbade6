"""`ft serve --ranks 2`: the experts of `tiny` split over two gloo processes (rank 0 serving and
mirroring every engine call, `engine.parallel_worker`) answer greedily as one process does, a
turn that continues a conversation included, with the attention and DeltaNet layers split by heads
(--split heads) or chosen by timing both at warm-up (the default, logged), and with each rank
offloading its own experts within its budget (--gpu-memory: one memory plan a rank, printed before
loading, each rank's engine configured from its own); SIGTERM ends both processes cleanly."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx
import pytest
import torch

from engine import footprint
from engine.engine_config import DEFAULT_CHUNK, EngineConfig
from engine.offload import GiB, budget_for, plan
from engine.parallel import ExpertParallel
from engine.runner import starting_capacity
from gateway.embedded import serve_process
from gateway.serve import config_from_args
from gateway.serve_prepare import expert_parallel, prepare
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


def stopped(proc: subprocess.Popen) -> str:
    """SIGTERM `proc` (a running `ft serve`): its output, once it exited cleanly."""
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(60)
    log = proc.stdout.read() if proc.stdout else ""
    assert code == 0, log
    return log


def children(proc: subprocess.Popen) -> list[int]:
    return [int(pid) for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]


def offload_gib(slots: int, world: int = 2) -> float:
    """A rank's budget that leaves `slots` of its tiny experts per layer on the device as `ft serve`
    plans it (CPU chunk, 4 sequences), half a slot spare: its plan's parts, from the footprint."""
    fp = footprint.of_preset("tiny")
    c = fp.config
    p = plan(c, fp.dense, 1 << 50, fp.dtype, EngineConfig().decode_slots, starting_capacity(torch.device("cpu")),
             DEFAULT_CHUNK["cpu"], expert_bytes=fp.expert, experts=c.num_experts // world)
    return (budget_for(c, p, slots) + fp.expert * c.num_hidden_layers // 2) / GiB


@pytest.fixture(scope="module")
def single() -> list[dict]:
    """The answers of one process."""
    proc, url = serve_process(["--preset", "tiny"])
    try:
        return answers(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_two_ranks_answer_as_one_process_and_stop_on_sigterm(single):
    for split in ("auto", "heads"):
        proc, url = serve_process(["--preset", "tiny", "--ranks", "2", "--split", split])
        try:
            followers = children(proc)
            assert len(followers) == 1
            assert answers(url) == single
        finally:
            log = stopped(proc)
        layers = "split by heads" if split == "heads" else ""  # auto: whichever was faster
        assert f"attention and DeltaNet layers {layers}" in log and ("at warm-up" in log) == (split == "auto"), log
        assert not any(Path(f"/proc/{pid}").exists() for pid in followers)  # reaped by rank 0 before it left


def test_two_ranks_offloading_their_experts_answer_as_one_process(single):
    """Each rank keeps 2 of its 4 experts a layer on the device: rank 0 prints both plans before
    loading and offloads as its own says."""
    proc, url = serve_process(["--preset", "tiny", "--ranks", "2", "--gpu-memory", repr(offload_gib(2)), "--max-running", "4"])
    try:
        assert answers(url) == single
    finally:
        log = stopped(proc)
    assert "plan: cpu (rank 0)" in log and "plan: cpu (rank 1)" in log
    assert log.index("plan: cpu (rank 1)") < log.index("ft serve: loading tiny"), log
    assert "experts offloaded: 2 of 4 per layer" in log and "expert offload: 2 of 4 experts per layer" in log, log


def test_each_rank_gets_its_engine_config_from_its_own_plan(capsys):
    args = serve_args("--preset", "tiny", "--ranks", "2", "--gpu-memory", repr(offload_gib(2)), "--max-running", "2")
    assert not prepare(args)
    assert "plan: cpu (rank 0)" in capsys.readouterr().out
    config = config_from_args(args)
    engines = [config.engine, *config.rank_engines]
    assert [(e.device, e.expert_parallel) for e in engines] == [("cpu", ExpertParallel(r, 2)) for r in range(2)]
    assert [e.gpu_memory_gib for e in engines] == args.rank_gpu_memory and args.rank_gpu_memory[0] is not None
    assert {e.max_running for e in engines} == {2}
    args.rank_gpu_memory = [1.0, 2.0]  # GPUs with different free memory: each rank's budget is its own
    assert [e.gpu_memory_gib for e in (config_from_args(args).engine, *config_from_args(args).rank_engines)] == [1, 2]


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
                          (["--split", "heads"], "--split heads: the heads are split over the ranks")):
        with pytest.raises(ValueError, match=problem):
            expert_parallel(serve_args(*argv))
