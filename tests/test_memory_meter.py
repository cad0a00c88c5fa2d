"""`loom.profile.memory_meter.MemoryMeter`: exact live and peak bytes of known allocation
patterns (the measurement `benchmarks/memory.py` checks the memory model with)."""

from __future__ import annotations

import torch

from loom.profile import memory_meter
from loom.profile.memory_meter import MemoryMeter

F32 = 4


def test_alloc_free_and_views_exact():
    with MemoryMeter() as m:
        a = torch.empty(1000)
        b = torch.empty(2000)
        v = b[10:20].view(2, 5)  # a view: the same storage, no new bytes
        assert m.live_bytes == 3000 * F32 and m.peak_bytes == 3000 * F32
        del a
        assert m.live_bytes == 2000 * F32
        c = torch.empty(500, dtype=torch.float64)
        assert m.live_bytes == 2000 * F32 + 500 * 8
        del b
        assert m.live_bytes == 2000 * F32 + 500 * 8  # ``v`` keeps b's storage alive
        del v
        assert m.live_bytes == 500 * 8
        assert m.peak_bytes == 3000 * F32
        m.reset_peak()
        assert m.peak_bytes == 500 * 8
        del c
        assert m.live_bytes == 0
    m.close()


def test_autograd_saved_tensors_and_gradients():
    w = torch.randn(64, 32, requires_grad=True)  # before the meter: tracked explicitly
    x = torch.randn(8, 64)
    with MemoryMeter() as m:
        m.track([w, x, w])  # counted once each
        base = (64 * 32 + 8 * 64) * F32
        assert m.live_bytes == base
        y = x @ w  # 8 x 32, keeps x and w (already live) for the backward
        h = torch.tanh(y)  # keeps its output h for the backward; y is freed once dropped
        del y
        assert m.live_bytes == base + 8 * 32 * F32
        loss = h.sum()
        before_backward = m.live_bytes
        loss.backward()
        # the gradient of w stays; every temporary of the backward is gone again
        assert w.grad is not None
        assert m.live_bytes == before_backward + 64 * 32 * F32
        assert m.peak_bytes >= m.live_bytes
        del h, loss
        assert m.live_bytes == base + 64 * 32 * F32
    m.close()


def test_track_live_finds_existing_tensors():
    keep = torch.zeros(12345, dtype=torch.uint8)
    with MemoryMeter() as m:
        m.track_live()
        assert m.live_bytes >= keep.numel()
        before = m.live_bytes
        del keep
        assert m.live_bytes == before - 12345
    m.close()


def test_in_place_resize_is_seen():
    with MemoryMeter() as m:
        t = torch.empty(1000)
        t.untyped_storage().resize_(0)  # as FSDP2 frees an unsharded parameter
        assert m.live_bytes == 0
        t.untyped_storage().resize_(4000)  # and gathers it again
        assert m.live_bytes == 4000
        torch.ones(1000, out=t)  # an operator returning it: the same storage, counted once
        assert m.live_bytes == 4000 and m.peak_bytes == 4000
        m.refresh()
        assert m.live_bytes == 4000
    m.close()
    # outside every meter the storage method is PyTorch's own again
    assert torch.UntypedStorage.resize_ is memory_meter._resize


def test_wrapper_subclasses_count_their_inner_tensors_only():
    # a DTensor-like wrapper (its storage a placeholder): only the tensors it wraps hold bytes
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = torch.ones(100), torch.ones(100)
    wrapped = TwoTensor(a, b)
    with MemoryMeter() as m:
        m.track([wrapped])
        assert m.live_bytes == 2 * 100 * F32
        m.track([a, b])  # the same storages: counted once
        assert m.live_bytes == 2 * 100 * F32
        # an operator on the wrapper: its new inner tensors are made inside the subclass's own
        # dispatch, out of the mode's sight (a sequence-parallel norm's output), yet counted
        doubled = wrapped * 2
        assert m.live_bytes == 4 * 100 * F32
        del doubled
        assert m.live_bytes == 2 * 100 * F32
    m.close()
