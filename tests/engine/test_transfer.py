"""The pinned slabs captures are cut from (`SlabPool`), on host tensors: a slab is cut again once no
tensor cut from it is alive, and only then."""

from __future__ import annotations

import torch

from engine.transfer import ALIGN, SlabPool


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_slab_is_cut_again_once_nothing_cut_from_it_is_alive():
    made: list[int] = []
    pool = SlabPool(1024, lambda n: made.append(n) or torch.zeros(n, dtype=torch.uint8))
    piece = 300  # takes 320 bytes of a slab (ALIGN): three a slab
    assert -(-piece // ALIGN) * ALIGN == 320
    first = [pool.take(piece) for _ in range(3)]
    second = pool.take(piece)  # the first slab is full
    slab0, slab1 = storage(first[0]), storage(second)
    assert len(pool.slabs) == 2 and slab0 != slab1 and {storage(t) for t in first} == {slab0}
    kept = first[1].view(torch.float16)[10:]  # a view of a cut tensor holds its slab too
    del first
    rest = [pool.take(piece) for _ in range(3)]  # two fill the second slab; the first is still held
    assert [storage(t) for t in rest[:2]] == [slab1, slab1] and storage(rest[2]) not in (slab0, slab1)
    assert len(pool.slabs) == 3
    del kept
    more = [pool.take(piece) for _ in range(3)]  # the third slab fills, then the first is free again
    assert storage(more[-1]) == slab0 and len(pool.slabs) == 3
    assert pool.take(1024 - 320).shape == (704,) and len(pool.slabs) == 3  # the rest of the first slab
    del second, rest
    assert storage(pool.take(piece)) == slab1  # the second slab, freed, before any new one
    pool.reserve(5)
    assert made == [1024] * 5 and len(pool.slabs) == 5


def test_cut_tensors_do_not_overlap():
    pool = SlabPool(4096, lambda n: torch.zeros(n, dtype=torch.uint8))
    pieces = [pool.take(n) for n in (1, 63, 64, 65, 1000, 2000)]
    for i, t in enumerate(pieces):
        t.fill_(i + 1)
    assert all(t.eq(i + 1).all() for i, t in enumerate(pieces))


def test_runs_copy_neighbours_in_one_buffer_together_and_nothing_else():
    """A layer's captures are views of one device buffer (with the segments nobody captured between
    them): they go to host memory as runs of that buffer, a gap no wider than the next tensor copied
    along, a run at most RUN bytes; other storages and far-apart views are runs of their own."""
    from engine.transfer import RUN, _runs  # noqa: PLC0415

    finals = torch.zeros(6, 4, 8)  # 128 bytes a row
    other = torch.zeros(3, 5, dtype=torch.bfloat16)
    items = [
        (0, "rec", finals[3]),
        (1, "rec", finals[0]),
        (2, "rec", finals[1]),
        (0, "conv", other[1]),
        (3, "rec", finals[5]),
    ]
    runs = {storage.data_ptr(): (lo, hi, [(g, name) for g, name, _ in run]) for storage, lo, hi, run in _runs(items)}
    # rows 0, 1, 3 (row 2 copied along: no wider than row 3) and 5 (row 4 along) are one run
    assert runs == {
        storage(finals): (0, 768, [(1, "rec"), (2, "rec"), (0, "rec"), (3, "rec")]),
        storage(other): (10, 20, [(0, "conv")]),
    }
    far = torch.zeros(RUN // 4 + 64)  # fp32: a run's most and 256 bytes
    (a, b) = _runs([(0, "x", far[:32]), (0, "y", far[-32:])])
    assert (a[1], a[2], b[1], b[2]) == (0, 128, far.nbytes - 128, far.nbytes)  # too far apart for one run
    wide = torch.zeros(RUN // 4 + 16)
    (first, second) = _runs([(0, "x", wide[: len(wide) // 2 + 8]), (0, "y", wide[len(wide) // 2 + 8 :])])
    assert first[2] == second[1]  # adjacent, but together over a run's most
