"""Point-to-point communication of variable-shape tensors along the edges of the stage DAG.

Activations between stages change shape with every microbatch (a microbatch with five images
sends more vision tokens than one with none). Where the receiver cannot know the shape, a
tensor travels as two messages: a small fixed-size int64 header (dtype, rank, shape) and then
the payload; the receiver learns the shape from the header and allocates exactly what arrives.
Where both sides know the shape in advance (a gradient has the shape of the activation the
receiver itself sent; the executor derives others from the microbatch's metadata), only the
payload travels (`send` with ``header=False``, `recv_shaped`): every message costs a gloo
round of its own, so halving them is most of the communicator's per-action overhead.
Empty tensors send only the header, or nothing when the shape is known.

Sends are asynchronous (``isend``); the communicator keeps their handles and tensors alive until
`wait_sends`, which the executor calls at the end of every iteration and `close` calls once more
before the process group is destroyed (a send still in flight at destruction aborts the process).
Receives block. Tags keep concurrent messages between the same two ranks apart on gloo; NCCL
ignores tags and matches messages in issue order, which the IR's per-edge ordering preserves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MAX_DIMS = 6
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]
_DTYPE_INDEX = {d: i for i, d in enumerate(_DTYPES)}
_HEADER_LEN = 2 + MAX_DIMS


def _header(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > MAX_DIMS:
        raise ValueError(f"cannot send a {t.dim()}-d tensor between stages (at most {MAX_DIMS} dims)")
    if t.dtype not in _DTYPE_INDEX:
        raise ValueError(f"cannot send dtype {t.dtype} between stages; supported: {_DTYPES}")
    values = [_DTYPE_INDEX[t.dtype], t.dim(), *t.shape]
    return torch.tensor(values + [0] * (_HEADER_LEN - len(values)), dtype=torch.int64)


class P2PCommunicator:
    """Sends and receives tensors of any shape between two ranks.

    ``device`` is where payloads live (CPU for gloo, the local GPU for NCCL); headers travel on
    the same device because NCCL only moves device memory.
    """

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None):
        self.device = device
        self.group = group
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor, peer: int, tag: int, header: bool = True) -> None:
        """Post ``tensor`` to ``peer``; ``header=False`` when the receiver knows its shape and
        dtype (it then calls `recv_shaped`)."""
        tensor = tensor.detach().contiguous()
        if header:
            h = _header(tensor).to(self.device)
            self._pending.append((dist.isend(h, peer, group=self.group, tag=2 * tag), h))
        if tensor.numel():
            self._pending.append((dist.isend(tensor, peer, group=self.group, tag=2 * tag + 1), tensor))

    def recv(self, peer: int, tag: int) -> torch.Tensor:
        """Receive a tensor sent with its header."""
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
        dist.irecv(header, peer, group=self.group, tag=2 * tag).wait()
        values = header.tolist()
        return self.recv_shaped(values[2:2 + values[1]], _DTYPES[values[0]], peer, tag)

    def recv_shaped(self, shape: list[int] | tuple[int, ...] | torch.Size, dtype: torch.dtype, peer: int,
                    tag: int) -> torch.Tensor:
        """Receive a tensor of a shape and dtype both sides know (sent with ``header=False``)."""
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
