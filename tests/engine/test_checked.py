"""`Checked` (engine/ops/gpu/checked.py): a fast kernel is kept only after it matched its torch
version; an error keeps the torch version, running out of memory is raised with no verdict."""

from __future__ import annotations

import pytest
import torch

from engine.ops.gpu.checked import Checked


def test_a_fast_kernel_that_matches_is_used():
    calls = []
    checked = Checked("double", lambda x: (calls.append("fast"), x * 2)[1], lambda x: x + x)
    x = torch.arange(4.0)
    assert torch.equal(checked(x), x * 2) and checked.verdict is True
    checked(x)
    assert calls == ["fast", "fast", "fast"]  # checked once against the torch version, then used


def test_an_error_or_a_mismatch_keeps_the_torch_version():
    def broken(x):
        raise RuntimeError("no kernel for this device")

    for fast in (broken, lambda x: x * 3):
        checked = Checked("double", fast, lambda x: x + x)
        assert torch.equal(checked(torch.ones(3)), torch.full((3,), 2.0)) and checked.verdict is False


def test_out_of_memory_is_raised_and_leaves_the_kernel_unchecked():
    """Under a memory budget, warm-up shrinks the expert cache and runs the forward again: the
    kernel that ran out of memory there must still be tried, not replaced for good."""
    fail = [True]

    def fast(x):
        if fail[0]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB")
        return x * 2

    checked = Checked("double", fast, lambda x: x + x)
    with pytest.raises(torch.OutOfMemoryError):
        checked(torch.ones(2))
    assert checked.verdict is None
    fail[0] = False
    assert torch.equal(checked(torch.ones(2)), torch.full((2,), 2.0)) and checked.verdict is True


def test_arguments_the_fast_kernel_does_not_apply_to_run_the_torch_version_unjudged():
    """`applies` (the fused DeltaNet step: up to `recurrent.FUSED_ROWS` rows): a call outside it
    runs the torch version and leaves the verdict open, so the fast kernel is still checked on
    the first call it applies to, not trusted on the strength of a trial it never ran."""
    calls = []

    def fast(x):
        calls.append(len(x))
        return x * 3  # wrong: only a trial on arguments it applies to can find that out

    checked = Checked("double", fast, lambda x: x + x, applies=lambda args: len(args[0]) <= 2)
    assert torch.equal(checked(torch.ones(5)), torch.full((5,), 2.0)) and checked.verdict is None and calls == []
    assert torch.equal(checked(torch.ones(2)), torch.full((2,), 2.0)) and checked.verdict is False and calls == [2]
