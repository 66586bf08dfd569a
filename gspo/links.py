"""How a trainer and its rollout workers talk: queues to processes it starts, or messages between ranks of a torchrun world.

    link = LocalLink(n, target, args)     # the trainer starts n worker processes (torch.multiprocessing, spawn)
    link = RankLink(dist, n)              # the last n ranks of the torchrun world are the workers
    link.send(w, msg); link.recv(timeout) -> (kind, worker, payload) or None; link.check(); link.close()

A message is a tuple, pickled (tensors included). The trainer sends requests and weights to
worker w; workers send results back. Between ranks they travel on `dist.link`, a gloo group of
every rank: only trainer rank 0 sends requests, each worker answers every trainer process with
its share; a thread per worker receives, so that neither side's sends wait for the other's
work. Worker ends: `QueueEnd` and `RankEnd` (`next(timeout)`, `put(msg, dest)`).
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time

import torch
import torch.distributed as torch_dist


class WorkerDied(Exception):
    """A worker is gone: (worker index, how, its pid or None)."""


def _send(obj, dst: int, group) -> None:
    torch_dist.send_object_list([obj], dst=dst, group=group)


def _get(q, timeout: float):
    """The next item of queue `q`, or None after `timeout` seconds without one."""
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        return None


def _recv(src: int, group):
    box = [None]
    torch_dist.recv_object_list(box, src=src, group=group)
    return box[0]


class LocalLink:
    """Worker processes this trainer process starts; each gets its requests queue and shares one results queue."""

    def __init__(self, n: int, target, args_of):
        # tensors travel as files in /dev/shm: a worker killed after it sent its batch leaves the
        # batch readable (with file descriptors, fetched from the sender, reading it would fail)
        torch.multiprocessing.set_sharing_strategy("file_system")
        ctx = torch.multiprocessing.get_context("spawn")
        self.results = ctx.Queue()
        self.requests = [ctx.Queue() for _ in range(n)]
        self.procs = [ctx.Process(target=target, name=f"gspo-rollout-worker-{i}", daemon=True,
                                  args=(*args_of(i), QueueEnd(self.requests[i], self.results)))
                      for i in range(n)]
        for p in self.procs:
            p.start()
        self.sender = True  # this process sends the requests

    def send(self, w: int, msg) -> None:
        self.requests[w].put(msg)

    def recv(self, timeout: float):
        return _get(self.results, timeout)

    def check(self) -> None:
        for w, p in enumerate(self.procs):
            if not p.is_alive():
                code = p.exitcode
                how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
                raise WorkerDied(w, how, p.pid)

    def close(self) -> None:
        for q in self.requests:
            try:
                q.put(("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.time() + 10
        for p in self.procs:
            p.join(timeout=max(0.1, deadline - time.time()))
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        for q in [*self.requests, self.results]:
            q.cancel_join_thread()
            q.close()
        self.procs, self.requests, self.results = [], [], None  # semaphores released now, not leaked at os._exit


class QueueEnd:
    """A worker process's end of a LocalLink."""

    def __init__(self, requests, results):
        self.requests, self.results, self.parent = requests, results, os.getpid()  # made in the trainer's process

    def next(self, timeout: float):
        """The next request; None after `timeout` seconds without one; ("stop",) once the trainer is gone."""
        msg = _get(self.requests, timeout)
        return ("stop",) if msg is None and os.getppid() != self.parent else msg

    def put(self, msg, dest=None) -> None:
        self.results.put(msg)


class RankLink:
    """A trainer process's end of the rollout ranks (the last n ranks of the torchrun world)."""

    def __init__(self, dist, n: int):
        self.dist, self.group, self.first = dist, dist.link, dist.world  # worker w is rank world + w
        self.sender = dist.rank == 0
        self.inbox: queue.Queue = queue.Queue()
        self.failed: dict[int, str] = {}
        self.threads = [threading.Thread(target=self._listen, args=(w,), daemon=True, name=f"gspo-rollout-rank-{w}")
                        for w in range(n)]
        for t in self.threads:
            t.start()

    def _listen(self, w: int) -> None:
        while True:
            try:
                msg = _recv(self.first + w, self.group)
            except Exception as e:  # the rank is gone (its connection closed)
                self.failed[w] = " ".join(str(e).split())[:200]
                return
            if msg[0] == "bye":
                return
            self.inbox.put(msg)

    def send(self, w: int, msg) -> None:
        if self.sender:
            _send(msg, self.first + w, self.group)

    def recv(self, timeout: float):
        return _get(self.inbox, timeout)

    def check(self) -> None:
        for w, why in self.failed.items():
            raise WorkerDied(w, f"its connection failed: {why}", None)

    def close(self) -> None:
        for w in range(len(self.threads)):
            if w not in self.failed:
                try:
                    self.send(w, ("stop",))
                except Exception:  # noqa: BLE001 (a rank already gone)
                    pass
        for t in self.threads:
            t.join(timeout=30)


class RankEnd:
    """A rollout rank's end: requests from trainer rank 0, results to each trainer process."""

    def __init__(self, group, trainers: int):
        self.group, self.trainers = group, trainers
        self.inbox: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._listen, daemon=True, name="gspo-rollout-requests")
        self.thread.start()

    def _listen(self) -> None:
        while True:
            try:
                msg = _recv(0, self.group)
            except Exception:  # trainer rank 0 is gone
                self.inbox.put(("stop",))
                return
            self.inbox.put(msg)
            if msg[0] == "stop":
                return

    def next(self, timeout: float):
        return _get(self.inbox, timeout)

    def put(self, msg, dest: int) -> None:
        _send(msg, dest, self.group)

    def close(self) -> None:
        for r in range(self.trainers):
            _send(("bye",), r, self.group)
