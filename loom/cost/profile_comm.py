"""The communication costs a profile holds (`Communication`), fitted from the rows that
`loom.profile.comm.message_pass` measures with the executor's communicator."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from loom.cost.profile_fit import LinearFit


@dataclass
class Communication:
    """Message and collective costs measured on two local processes of this machine, as the
    executor's communicator (`loom.runtime.comm`: a header, then the payload) sees them:

    - ``send_post``: the sender's time in ``send`` (posting both messages);
    - ``recv_ready``: the receiver's time in ``recv`` for a message posted before, the sender
      computing meanwhile (a pipeline stage goes on to its next forward or backward after a
      send). gloo moves a message only once its receive is posted, and on a machine with as
      many cores as ranks the sender's communication thread then has to win a core from the
      sender's compute: this is a whole transfer plus that wait, paid by the receiver;
    - ``latency``: from the end of the sender's post to the end of a receive that was already
      waiting, the sender computing on meanwhile;
    - ``recv_ready_idle``, ``latency_idle``: the same with the sender waiting instead of
      computing (for comparison; the cost model uses the two above);
    - ``latency_full``: ``latency`` with every core of the host computing while the receiver
      waits (the sender and ``cores - 1`` co-running processes): the woken receiver, and
      gloo's thread that reads the message, must first win a core from a computing process
      (`wake_delay`);
    - ``all_reduce``: a gradient bucket's flatten + all-reduce + unflatten on ``world`` ranks;
    - ``thread_send``, ``thread_recv``: CPU seconds a message costs the sender's and the
      receiver's process outside the calling thread (gloo's loop thread writes and reads the
      socket): work that competes for the host's cores with the ranks' compute (`thread_cpu`).
    """

    send_post: LinearFit
    recv_ready: LinearFit
    latency: LinearFit
    all_reduce: LinearFit
    world: int = 2
    recv_ready_idle: LinearFit | None = None
    latency_idle: LinearFit | None = None
    latency_full: LinearFit | None = None
    thread_send: LinearFit | None = None
    thread_recv: LinearFit | None = None

    def thread_cpu(self, nbytes: float) -> tuple[float, float]:
        """CPU seconds of the communicator's threads for one message of ``nbytes``, on the
        sender's process and on the receiver's (0 where the profile lacks the measurement).
        The simulator's core sharing (`loom.sim.sharing`) puts it on their hosts' cores while the
        message moves."""
        def at(fit: LinearFit | None) -> float:
            return max(fit.time(nbytes), 0.0) if fit is not None and fit.points else 0.0
        return at(self.thread_send), at(self.thread_recv)

    def wake_delay(self) -> float:
        """Seconds a receiver blocked on a message loses when the message arrives while every
        core of its host computes: the median over the measured sizes of ``latency_full`` less
        ``latency`` (0 without the measurement, or where the host had cores to spare). The
        simulator's core sharing (`loom.sim.sharing.CoreSharing.wake_s`) adds it to such
        receives; processor sharing alone would hand the receiver its share of a core at once."""
        if self.latency_full is None or not self.latency_full.points:
            return 0.0
        return max(statistics.median(t - self.latency.time(b) for b, t in self.latency_full.points), 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {k: (asdict(v) if isinstance(v, LinearFit) else v) for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Communication":
        return cls(**{k: (LinearFit(**v) if isinstance(v, dict) else v) for k, v in d.items()})


def fit_communication(passes: Sequence[Mapping[str, Sequence[Sequence[float]]]], world: int = 2) -> Communication:
    """`Communication` from the rows of several `message_pass` calls (any ranks): the median
    per quantity and size, then a linear fit per quantity."""
    points: dict[str, dict[float, list[float]]] = {}
    for rows in passes:
        for key, pts in rows.items():
            for nbytes, secs in pts:
                points.setdefault(key, {}).setdefault(float(nbytes), []).append(float(secs))
    fits = {key: LinearFit.fit([(b, statistics.median(v)) for b, v in sorted(per.items())])
            for key, per in points.items()}
    return Communication(**fits, world=world)
