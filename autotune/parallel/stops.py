"""How one rank's failure stops every rank within seconds, each naming it, instead of leaving the
others waiting in a collective until the process group's timeout.

Before training, a step that touches the data runs on every rank and one all-reduce says whether it
raised anywhere (:func:`on_every_rank`). Inside a lockstep step (FSDP2: every forward and backward
is collective) the failing rank writes its error to the store and breaks its communication
(:func:`stop_every_rank`; with NCCL, :class:`failure_watch` on the others). Under a launcher that
stops every rank with SIGTERM as soon as one exits, a rank says which one did (:class:`naming_sigterm`).
Everything here is a no-op in a single process.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch

from autotune.parallel.ranks import (
    FAILED_KEY,
    announce,
    gather,
    gather_numbers,
    is_distributed,
    lost_peer,
    peers_here,
    process_store,
    stopped_by_signal,
    world,
)

__all__ = ["ACK_SECONDS", "failure_watch", "last_words", "naming_sigterm", "on_every_rank", "stop_every_rank"]


def on_every_rank(fn: Any, *args: Any, device: torch.device | None = None, group: Any = None, what: str = "",
                  agree: Sequence[tuple[str, float, Any]] = ()) -> Any:
    """Run ``fn(*args)`` on every rank; if it raised on any rank, raise on every rank.

    The rank that failed raises its own error; the others an AutotuneError naming it. For steps that
    touch the data before training (a dataset that raises on one rank must not leave the others
    waiting in the next collective). ``agree``: ``(name, number, shown)`` settings every rank must
    share, carried in the same all-reduce; a difference raises ValueError on every rank, naming the
    ranks and their values (``shown(number)``).
    """
    error: BaseException | None = None
    result = None
    try:
        result = fn(*args)
    except Exception as exc:
        error = exc
    if not is_distributed():
        if error is not None:
            raise error
        return result
    announce(group)  # where a peer finds this process (a peer that exits is then named, see lost_peer)
    # One small all-reduce says whether any rank failed (and carries what must agree); only then do the
    # messages travel.
    rows = gather_numbers([error is not None, *(number for _, number, _ in agree)], device, group)
    if not any(row[0] for row in rows):
        for i, (name, _, shown) in enumerate(agree, start=1):
            values = [row[i] for row in rows]
            if len(set(values)) > 1:
                ranks = ", ".join(f"rank {r}: {shown(v)}" for r, v in enumerate(values))
                raise ValueError(f"Invalid {name}: the ranks disagree ({ranks}); every rank must train with the same {name}")
        return result
    messages = gather(None if error is None else f"{type(error).__name__}: {error}", device, group)
    if error is not None:
        raise error
    from autotune.errors import AutotuneError

    rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
    stopped = AutotuneError(f"rank {rank} failed {what}, so every rank stops: {message}")
    stopped.autotune_elsewhere = True  # type: ignore[attr-defined]
    raise stopped


def stop_every_rank(own: BaseException, group: Any = None, *, what: str) -> NoReturn:
    """A rank's step raised inside a lockstep step (FSDP2: every forward and backward is collective):
    make every rank stop within seconds, each naming the cause, instead of leaving the others waiting
    in a collective until the process group's timeout.

    On the rank whose own code failed: its error is written to the process group's store, the
    process group is aborted (its peers' pending collectives then fail at once), and it raises its own
    error after the others have read it (at most ``ACK_SECONDS``). On a rank whose collective failed
    because a peer aborted: an :class:`AutotuneError` naming that rank and its error. The process
    group cannot be used afterwards: the run is over.
    """
    from autotune.errors import AutotuneError

    store = process_store()
    rank, size = world(group)
    told = _read_failure(store)
    if told is not None and told[0] != rank:
        _ack(store, rank)
        stopped = AutotuneError(f"rank {told[0]} failed {what}, so every rank stops: {told[1]}")
        stopped.autotune_group_broken = True  # type: ignore[attr-defined]
        raise stopped from own
    lost = lost_peer(own, group, what=what)
    if lost is not None:  # not this rank's own failure: a peer went away
        _abort(group)  # the ranks still waiting on this one stop too, and find the same rank gone
        lost.autotune_group_broken = True  # type: ignore[attr-defined]
        raise lost from own
    if store is not None:
        try:
            store.set(FAILED_KEY, f"{rank}\n{type(own).__name__}: {own}")
        except Exception:
            store = None
    _abort(group)
    if store is not None:
        _wait_for_acks(store, [r for r in range(size) if r != rank])
    own.autotune_group_broken = True  # type: ignore[attr-defined]  # no collective may follow: the group is aborted
    raise own


ACK_SECONDS = 10.0  # how long a failing rank waits for the others to read its error


def _read_failure(store: Any) -> tuple[int, str] | None:
    if store is None:
        return None
    try:
        if not store.check([FAILED_KEY]):
            return None
        text = store.get(FAILED_KEY).decode()
    except Exception:
        return None
    rank, _, message = text.partition("\n")
    return int(rank), message


def _ack(store: Any, rank: int) -> None:
    try:
        store.set(f"{FAILED_KEY}/read/{rank}", "1")
    except Exception:
        pass


def _wait_for_acks(store: Any, ranks: Sequence[int]) -> None:
    import datetime

    try:
        store.wait([f"{FAILED_KEY}/read/{r}" for r in ranks], datetime.timedelta(seconds=ACK_SECONDS))
    except Exception:  # a peer that never reads it: its own collective has failed anyway
        pass


def _abort(group: Any) -> None:
    """Make the peers' pending collectives fail now.

    NCCL: the communicator is aborted (and the peers' :class:`failure_watch` aborts theirs). gloo
    has no abort that reaches a peer waiting in a receive: its connections close only when the
    process group is freed, which FSDP2's own references prevent. So this rank's TCP connections to
    its peers' processes (announced in the store; never the store's own) are shut down: each peer's
    pending receive fails at once with "connection closed by peer".
    """
    dist = torch.distributed
    try:
        backend = dist.get_backend(group)
    except Exception:
        backend = None
    if backend == "nccl":
        try:
            dist.distributed_c10d._abort_process_group(group)
        except Exception:
            pass
        return
    _close_peer_connections(group)


def _close_peer_connections(group: Any) -> None:
    import socket

    import psutil

    store = process_store()
    if store is None:
        return
    peers = set(peers_here(group).values())
    store_port = getattr(store, "port", None) or int(os.environ.get("MASTER_PORT", "0") or 0)
    try:
        everyone = psutil.net_connections(kind="tcp")
        mine = psutil.Process().net_connections(kind="tcp")
    except Exception:
        return
    owner = {(c.laddr.ip, c.laddr.port): c.pid for c in everyone if c.laddr}
    for c in mine:
        if not c.raddr or c.fd is None or c.fd < 0 or store_port in (c.laddr.port, c.raddr.port):
            continue
        if owner.get((c.raddr.ip, c.raddr.port)) in peers:
            try:
                with socket.socket(fileno=os.dup(c.fd)) as s:
                    s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class failure_watch:
    """While a lockstep step runs with NCCL, a thread watches the store for another rank's failure and
    aborts this rank's process group, so that a collective this rank is blocked in fails at once
    (gloo's blocked collectives fail by themselves when the failing rank destroys its group)."""

    def __init__(self, group: Any = None, *, interval: float = 0.2) -> None:
        self.group, self.interval = group, interval
        self._stop: Any = None

    def __enter__(self) -> failure_watch:
        import threading

        dist = torch.distributed
        store = process_store()
        if store is None or not is_distributed() or dist.get_backend(self.group) != "nccl":
            return self
        rank = world(self.group)[0]
        self._stop = threading.Event()

        def watch() -> None:
            while not self._stop.wait(self.interval):
                told = _read_failure(store)
                if told is not None and told[0] != rank:
                    _abort(self.group)
                    return

        threading.Thread(target=watch, name="autotune-failure-watch", daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._stop is not None:
            self._stop.set()


class naming_sigterm:
    """While a run with several ranks is on: SIGTERM raises :func:`autotune.parallel.ranks.stopped_by_signal`'s
    error, naming the rank that exited, instead of ending the process without a word (``torchrun`` stops
    every rank with SIGTERM as soon as one exits, often before the others noticed). On the way out
    SIGTERM's default action comes back, written first when the run stopped on an error (``failure()``):
    that error is still on its way out of ``fit``, and a SIGTERM before Python printed it would end the
    rank without a word (:func:`last_words`). Only on the main thread, and only where SIGTERM has its
    default action (or a failed run's last words): a handler of yours is left alone."""

    def __init__(self, group: Any, failure: Callable[[], BaseException | None]) -> None:
        self.group, self.failure, self.active = group, failure, False

    def __enter__(self) -> naming_sigterm:
        handler = signal.getsignal(signal.SIGTERM)
        ours = handler is signal.SIG_DFL or getattr(handler, "autotune_last_words", False)
        self.active = bool(ours) and threading.current_thread() is threading.main_thread()
        if self.active:
            signal.signal(signal.SIGTERM, self._stopped)
        return self

    def _stopped(self, signum: int, frame: Any) -> None:
        # A second SIGTERM (the launcher's after another rank's, say) is ignored while this one is named
        # (at most a second), then ends the process at once, saying why first.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        error = stopped_by_signal(self.group)
        signal.signal(signal.SIGTERM, last_words(error))
        raise error

    def __exit__(self, *exc: Any) -> None:
        if self.active:
            failure = self.failure()
            signal.signal(signal.SIGTERM, last_words(failure) if isinstance(failure, Exception) else signal.SIG_DFL)


def last_words(error: BaseException) -> Any:
    """A SIGTERM handler for a rank whose run stops on ``error``: SIGTERM still ends the process as by
    default, but first writes the error to stderr. ``torchrun`` stops every rank as soon as one exits (and a
    rank may get two SIGTERMs: the launcher's and another rank's), and the SIGTERM can come while ``error``
    is still on its way out of ``fit``, before Python printed it: without this, the rank would end without
    a word."""
    said = f"autotune: SIGTERM ended this rank as its fit stopped on {type(error).__name__}: {error}\n".encode(errors="replace")

    def say(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        text = said
        try:  # to the process's stderr itself: while an error is printed, sys.stderr may be a buffer (torch's excepthook)
            while text:
                text = text[os.write(2, text):]
        except OSError:
            pass
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    say.autotune_last_words = True  # type: ignore[attr-defined]
    return say
