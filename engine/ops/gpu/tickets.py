"""Counters of the programs that share one result: each takes a ticket after storing its part, and the
last to take it finishes the result and resets the ticket (the GEMV's split-K sums, the MoE decode's down
projection and router, the DeltaNet decode step, the dense few-row GEMM)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TICKETS: dict[torch.device, torch.Tensor] = {}
TICKETS = 1 << 16  # (row, n-block) counters of the GEMV's split-K sums


def tickets(device: torch.device) -> torch.Tensor:
    """The GEMV's ticket counters on `device`: zeros, and left at zero by every launch (the last
    program of each sum resets its own). One set per device: the GEMVs of a device run one after
    another on its compute stream. Made outside any graph capture (the first forward is eager)."""
    if device not in _TICKETS:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the GEMV's counters are made by an eager forward before any capture")
        _TICKETS[device] = torch.zeros(TICKETS, dtype=torch.int32, device=device)
    return _TICKETS[device]


@triton.jit
def last_to_finish(ticket, programs):
    """Called by each of `programs` programs after storing its partial results: whether it is the
    last to do so (then every partial is visible to it; it resets `ticket` to zero when done).
    The barrier orders the CTA's stores before the ticket, taken with acquire-release at GPU scope."""
    tl.debug_barrier()
    return tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == programs - 1
