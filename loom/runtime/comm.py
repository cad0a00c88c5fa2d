"""Point-to-point communication of variable-shape tensors along the edges of the stage DAG.

Activations between stages change shape with every microbatch (a microbatch with five images
sends more vision tokens than one with none), so every tensor travels as two messages: a small
fixed-size int64 header (dtype, rank, shape) and then the payload. The receiver learns the shape
from the header and allocates exactly what arrives. Empty tensors send only the header.

Sends are asynchronous (``isend``); the communicator keeps their handles and tensors alive until
`wait_sends` at the end of the iteration, which matches the IR's rule that sends never block.
Receives block. Tags keep concurrent messages between the same two ranks apart on gloo; NCCL
ignores tags and matches messages in issue order, which the IR's per-edge ordering preserves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MAX_DIMS = 6
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]
_HEADER_LEN = 2 + MAX_DIMS


def _header(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > MAX_DIMS:
        raise ValueError(f"cannot send a {t.dim()}-d tensor between stages (at most {MAX_DIMS} dims)")
    if t.dtype not in _DTYPES:
        raise ValueError(f"cannot send dtype {t.dtype} between stages; supported: {_DTYPES}")
    h = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    h[0] = _DTYPES.index(t.dtype)
    h[1] = t.dim()
    h[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


class P2PCommunicator:
    """Sends and receives tensors of any shape between two ranks.

    ``device`` is where payloads live (CPU for gloo, the local GPU for NCCL); headers travel on
    the same device because NCCL only moves device memory.
    """

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None):
        self.device = device
        self.group = group
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        header = _header(tensor).to(self.device)
        self._pending.append((dist.isend(header, peer, group=self.group, tag=2 * tag), header))
        if tensor.numel():
            self._pending.append((dist.isend(tensor, peer, group=self.group, tag=2 * tag + 1), tensor))

    def recv(self, peer: int, tag: int) -> torch.Tensor:
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
        dist.irecv(header, peer, group=self.group, tag=2 * tag).wait()
        header = header.cpu()
        dtype = _DTYPES[int(header[0])]
        shape = [int(s) for s in header[2 : 2 + int(header[1])]]
        out = torch.empty(shape, dtype=dtype, device=self.device)
        if out.numel():
            dist.irecv(out, peer, group=self.group, tag=2 * tag + 1).wait()
        return out

    def release_completed(self) -> None:
        """Drop sends that have completed, so their tensors are freed before the iteration ends."""
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
