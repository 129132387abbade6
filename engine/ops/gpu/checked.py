"""A fast kernel is used only after it has matched its plain-torch version once, on the first real
inputs (outside any CUDA graph capture); on a mismatch or an error the plain version is kept and
the reason logged. This keeps a new Triton kernel from silently corrupting results on a device or
library version it was never run on. Running out of memory is no verdict on the kernel: it is
raised, unchecked, to the caller (under a memory budget, warm-up gives up expert slots and runs the
forward again; engine/offload/)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


class Checked:
    def __init__(self, name: str, fast: Callable, slow: Callable, rtol: float = 2e-2, canon: Callable | None = None,
                 fresh: Callable | None = None, applies: Callable | None = None):
        """`canon(out, args)`: what of an output is compared (default: every tensor of it), where
        two right answers may differ (e.g. the order of ties). `fresh(args)`: copies of the
        arguments an op updates in place, for each of the two trial runs (the real call then runs
        once on the real arguments; `canon` sees the copies the run updated). `applies(args)`:
        whether the fast version is wanted for these arguments at all (default: always); where
        not, the slow one runs and nothing is judged."""
        self.name, self.fast, self.slow, self.rtol = name, fast, slow, rtol
        self.canon = canon or (lambda out, args: out)
        self.fresh = fresh or (lambda args: args)
        self.applies = applies or (lambda args: True)
        self.verdict: bool | None = None  # None: not checked yet

    def __call__(self, *args):
        if not self.applies(args):
            return self.slow(*args)
        if self.verdict is None:
            self.verdict = self._check(args)  # out of memory: raised, still unchecked
        return (self.fast if self.verdict else self.slow)(*args)

    def _check(self, args) -> bool:
        def trial(f: Callable) -> list[torch.Tensor]:
            copies = self.fresh(args)
            return _flat(self.canon(f(*copies), copies))

        try:
            got, want = trial(self.fast), trial(self.slow)
            errors = [((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item() for a, b in zip(got, want, strict=True)]
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001
            log.warning("%s: fast kernel failed (%s); using the torch version", self.name, exc)
            return False
        if not all(e <= self.rtol for e in errors):
            log.warning("%s: fast kernel off by %s; using the torch version", self.name, errors)
            return False
        return True


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    flat = []
    for item in out:
        flat.extend(_flat(item) if not isinstance(item, torch.Tensor) else [item])
    return flat
