"""Peak bytes of live tensors on the CPU, exactly, as a context manager (issue 9,
``benchmarks/memory.py``; usable by ``loom profile``).

The process's resident set size is too coarse to check a memory model with: the allocator keeps
freed pages, the interpreter and libraries weigh hundreds of MB, and it only grows. What the
cost model predicts (`loom.cost.memory`) is the bytes of tensors alive at once, so that is what
`MemoryMeter` counts: every tensor storage on the metered device, from the moment an operator
creates it to the moment its last reference (Python or C++: autograd's saved tensors, a view,
an optimizer's state) goes, at each operator call.

How: a `TorchDispatchMode` sees every operator's outputs (forward, backward, which runs in the
calling thread on the CPU, optimizer steps, collectives' buffers). The first time it sees a
storage it adds the storage's bytes to the live count and attaches a ``weakref.finalize`` to the
storage's Python object, which PyTorch keeps alive exactly as long as the C++ storage, so the
count drops when the storage is really freed. Storages that exist before the meter starts (the
parameters, the optimizer's state) are added by `MemoryMeter.track` or `track_live` (all tensors
the garbage collector can reach). A storage resized in place (FSDP2 frees and re-allocates its
unsharded parameters with ``untyped_storage().resize_``, which no operator sees) is re-measured
at the resize: while a meter is entered, ``UntypedStorage.resize_`` reports to it; also whenever
an operator returns the storage, and by `refresh`. A wrapper subclass (DTensor) holds no bytes of
its own: its inner tensors (``__tensor_flatten__``) are counted, since the ones its own dispatch
creates (a sequence-parallel norm's output) never pass through this mode as plain tensors.

CUDA has this built in: use ``torch.cuda.max_memory_allocated`` there (`peak_allocated`).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__  # what a tensor that is not a wrapper subclass has
_ACTIVE: list["MemoryMeter"] = []  # entered meters, innermost last
_resize = torch.UntypedStorage.resize_  # the original, restored when the last meter exits


def _metered_resize(storage: torch.UntypedStorage, size: int) -> Any:
    out = _resize(storage, size)
    for meter in _ACTIVE:
        meter._see_storage(storage)
    return out


class MemoryMeter(TorchDispatchMode):
    """Counts the bytes of live tensor storages on ``device`` (a device type: ``"cpu"``) while
    entered, and their peak. ``live_bytes``: now; ``peak_bytes``: the most at once since the
    meter started or `reset_peak`."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device).type
        self.live_bytes = 0
        self.peak_bytes = 0
        # id(storage) -> [bytes counted, its finalizer]; the finalizer holds no strong reference
        self._sizes: dict[int, list[Any]] = {}

    # ---- counting ------------------------------------------------------------------------------
    def _freed(self, key: int) -> None:
        entry = self._sizes.pop(key, None)
        if entry is not None:
            self.live_bytes -= entry[0]

    def _see(self, t: torch.Tensor) -> None:
        if t.device.type != self.device:
            return
        if type(t).__torch_dispatch__ is not _PLAIN_DISPATCH:
            # a wrapper subclass (DTensor): its storage is a placeholder of the global size;
            # count its inner tensors, which the subclass's own dispatch creates out of this
            # mode's sight (a sequence-parallel norm's sharded output exists only inside one)
            flatten = getattr(t, "__tensor_flatten__", None)
            if flatten is not None:
                for name in flatten()[0]:
                    inner = getattr(t, name)
                    if isinstance(inner, torch.Tensor):
                        self._see(inner)
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a wrapper subclass (DTensor) has none of its own
            return
        self._see_storage(storage)

    def _see_storage(self, storage: torch.UntypedStorage) -> None:
        if storage.device.type != self.device:
            return
        key = id(storage)
        n = storage.nbytes()
        entry = self._sizes.get(key)
        if entry is None:
            self._sizes[key] = [n, weakref.finalize(storage, self._freed, key)]
            self.live_bytes += n
        elif entry[0] != n:  # resized in place since we last saw it
            self.live_bytes += n - entry[0]
            entry[0] = n
        else:
            return
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count storages that existed before the meter started (each counted once)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._see(t)

    def track_live(self) -> None:
        """Count every tensor the garbage collector can reach now (parameters, gradients,
        optimizer states, buffers, data): the live bytes of a process at a step boundary."""
        # type(), not isinstance(): the latter reads ``__class__``, which some module proxies warn on
        self.track(o for o in gc.get_objects() if issubclass(type(o), torch.Tensor))

    def refresh(self) -> None:
        """Re-measure every counted storage (catches in-place resizes no operator returned)."""
        for key, entry in list(self._sizes.items()):
            storage = entry[1].peek()
            if storage is not None:
                n = storage[0].nbytes()
                self.live_bytes += n - entry[0]
                entry[0] = n
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now."""
        self.peak_bytes = self.live_bytes

    def close(self) -> None:
        """Stop following the counted storages (their finalizers detach)."""
        for entry in self._sizes.values():
            entry[1].detach()
        self._sizes.clear()

    def __enter__(self) -> "MemoryMeter":
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _metered_resize  # type: ignore[method-assign]
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _ACTIVE.remove(self)
            if not _ACTIVE:
                torch.UntypedStorage.resize_ = _resize  # type: ignore[method-assign]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._see(t)
        return out


def peak_allocated(device: torch.device) -> int:
    """``torch.cuda.max_memory_allocated`` of ``device`` (CUDA only): the CUDA allocator's own
    count of the same quantity `MemoryMeter` counts on the CPU."""
    if device.type != "cuda":
        raise ValueError(f"peak_allocated(device={device}): CUDA only; on the CPU enter a MemoryMeter")
    return torch.cuda.max_memory_allocated(device)
