"""How a trainer and its rollout workers talk: pipes and a spool to processes it starts, or messages between
ranks of a torchrun world.

    link = LocalLink(n, target, args)     # the trainer starts n worker processes (torch.multiprocessing, spawn)
    link = RankLink(dist, n)              # the last n ranks of the torchrun world are the workers
    link.send(w, msg); link.recv(timeout) -> (kind, worker, payload) or None; link.check(); link.close()
    end.start()                           # in the worker: its signals, and its exit when the trainer is gone

A message is a tuple. The trainer sends requests and weights to worker w; workers send results
back. Worker ends: `ProcessEnd` and `RankEnd` (`start()`, `next(timeout)`, `put(msg, dest)`).

**Local workers, and why this transport** (docs/async.md, "Reliability"). A result can be
megabytes (completions, dataset rows, reward parts); a pipe holds 64 KiB. Half written into a
pipe, such a message hung a trainer whose worker was killed mid-send, and a worker whose trainer
died blocked at exit on its queue's feeder thread. So a result never travels through a pipe: the
worker pickles it into a file of the link's spool directory (`/dev/shm` where it exists;
`$GSPO_SPOOL_DIR` chooses another), renames it into place once complete and sends only its name,
under `INLINE_BYTES`: one write of fewer than PIPE_BUF bytes, all of it or none. The trainer
reads every result with a real deadline whatever its size; a worker killed mid-write leaves a
partial file no one announced; one killed after it sent leaves its batch readable. Each worker
holds the only copy of its pipes' ends: its death is an end of file to the trainer, the
trainer's a broken pipe to it. Requests and weights go the other way, each message a small
handle (tensors in shared memory, the `file_system` strategy), written by a thread of the
trainer's that close() stops and joins.

**The spool's owner.** A trainer holds an exclusive `flock` on its spool's `lock` file from the
moment the spool exists until it removes it; the kernel drops the lock when the trainer dies. A
new trainer removes only the spools whose lock it can take (their owner is dead), so a spool
shared through `/dev/shm` between containers (`--ipc=host`) or a `$GSPO_SPOOL_DIR` shared between
hosts is never taken from a live trainer: the lock holds across pid namespaces, and across hosts
where the filesystem carries locks between them (NFS does; see docs/async.md).

**Ends.** A worker dies with its trainer: on Linux the kernel kills it (`PR_SET_PDEATHSIG`),
elsewhere a thread sees its parent change within `WATCH_S`. It ignores SIGINT (a terminal's
Ctrl-C reaches the whole process group: the trainer answers it, then stops the workers) and
honours SIGTERM once its trainer closes the link or is gone. `close()` escalates: the stop
request (read between batches), SIGTERM after `CLOSE_STOP_S`, SIGKILL after `CLOSE_TERM_S` more;
it also runs at exit, before multiprocessing's own exit joins children without a deadline.

**Ranks.** Between ranks messages travel on `dist.link`, a gloo group of every rank: only
trainer rank 0 sends requests, each worker answers every trainer process with its share; a
thread per worker receives, so that neither side's sends wait for the other's work. A rollout
rank whose trainer rank 0 is gone (its connection closed) exits within `GONE_GRACE_S`, mid-batch
or not; torchrun's agent stops the rest of the world. At the end of a run a rollout rank says
goodbye to each trainer process, rank 0 last (its goodbye releases the trainers' last barrier),
and a trainer that stopped waiting for it is no failure: the run is over.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import multiprocessing.connection
import os
import pickle
import queue
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.distributed as torch_dist

INLINE_BYTES = 256  # a message up to this size crosses the pipe itself (one atomic write: PIPE_BUF >= 512)
WATCH_S = 0.5  # how often a worker without PR_SET_PDEATHSIG checks that its trainer is alive
CLOSE_STOP_S = 2.0  # close: how long workers get to leave on the stop request ...
CLOSE_TERM_S = 3.0  # ... then after SIGTERM, before SIGKILL
GONE_GRACE_S = 2.0  # a rollout rank whose trainer rank 0 is gone: its time to leave on its own before it exits
SPOOL_PREFIX = "gspo-spool-"
SPOOL_LOCK = "lock"  # the file in a spool whose flock its owner holds while it lives


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


def spool_root() -> Path:
    """Where worker results wait to be read: $GSPO_SPOOL_DIR, else /dev/shm (memory) where it
    exists and is writable, else the temporary directory."""
    given = os.environ.get("GSPO_SPOOL_DIR")
    if given:
        return Path(given)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


_HELD: dict[Path, int] = {}  # this process's spools (resolved) -> the descriptor of each one's held lock


def make_spool(root: Path | None = None) -> Path:
    """A new spool directory for this process's link, holding its lock (`SPOOL_LOCK`) until
    `remove_spool`, after removing the spools of trainers that are gone (`sweep_spools`)."""
    root = root or spool_root()
    root.mkdir(parents=True, exist_ok=True)
    sweep_spools(root)
    spool = Path(tempfile.mkdtemp(prefix=f"{SPOOL_PREFIX}{os.getpid()}-", dir=root))
    # the lock file is made and locked under another name, then renamed: a sweeper that finds
    # `lock` finds it held (made under its own name, it could be locked by a sweeper before its
    # owner). A trainer killed before the rename leaves an empty spool that no run removes.
    fresh = spool / f".{SPOOL_LOCK}-new"
    fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:  # a filesystem without locks (NFS without its lock service: ENOLCK)
        os.close(fd)
        shutil.rmtree(spool, ignore_errors=True)
        raise OSError(f"could not lock the spool {spool} ({e.strerror or e}); set GSPO_SPOOL_DIR to a directory "
                      "whose filesystem has file locks (/dev/shm, a local disk)") from None
    _HELD[spool.resolve()] = fd  # before the rename: from then on a sweeper of this process must skip it
    os.rename(fresh, spool / SPOOL_LOCK)
    return spool


def sweep_spools(root: Path) -> None:
    """Remove the spools in `root` whose owner is dead: those whose lock this process can take.

    The lock, not the pid in the name, says whether the owner lives: a pid means nothing in
    another pid namespace (containers sharing /dev/shm) or on another host (a shared
    $GSPO_SPOOL_DIR), while the kernel drops a dead process's flock wherever it ran. Left alone:
    - a spool whose lock is held: its trainer lives;
    - this process's own (on NFS, flock is a POSIX lock, which does not conflict with the same
      process's lock and is dropped when the process closes any descriptor of the file);
    - a spool with no `lock` file: one being made (its lock file appears only once held), or one
      left by gspo 0.3.0 or before, whose owner cannot be told apart from a live trainer in
      another pid namespace. Those are the user's to remove (`rm -r /dev/shm/gspo-spool-*` while
      no run is live);
    - anything no trainer made: a spool that is a symbolic link, a lock that is a link, a fifo, a
      device (/dev/shm is everyone's: opening what another local process planted could wait on a
      serial port's carrier, or make a terminal this process's controlling one)."""
    for old in root.glob(f"{SPOOL_PREFIX}*"):
        if old.resolve() in _HELD:
            continue
        fd = _open_lock(old)
        if fd is None:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its trainer lives (or the filesystem has no locks: we cannot tell)
            continue
        finally:
            os.close(fd)  # released before the removal (NFS renames an open file it is asked to remove)
        shutil.rmtree(old, ignore_errors=True)  # a second sweeper removing it too is harmless


def _open_lock(spool: Path) -> int | None:
    """A descriptor of `spool`'s lock file, writable (NFS's lock for flock needs it); None where there
    is none, or it is not a regular file of the spool itself, links followed nowhere."""
    try:
        folder = os.open(spool, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # not a directory, a link, or another user's
        return None
    try:
        if not stat.S_ISREG(os.stat(SPOOL_LOCK, dir_fd=folder, follow_symlinks=False).st_mode):
            return None  # a link, a fifo, a device: not opened
        fd = os.open(SPOOL_LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY, dir_fd=folder)
    except OSError:  # no lock file, or another user's
        return None
    finally:
        os.close(folder)
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced since: opened without waiting, closed unread
        os.close(fd)
        return None
    return fd


def remove_spool(spool: Path) -> None:
    """Release this process's lock on `spool` and remove it with what it holds."""
    fd = _HELD.pop(spool.resolve(), None)
    if fd is not None:
        os.close(fd)
    shutil.rmtree(spool, ignore_errors=True)


def on_parent_death(sig: int) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux); False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, int(sig), 0, 0, 0) == 0  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


class LocalLink:
    """Worker processes this trainer process starts: a requests pipe and a results pipe each,
    results over INLINE_BYTES in the spool directory (see the module docstring)."""

    def __init__(self, n: int, target, args_of):
        # weights travel as files in /dev/shm, named in the pickled message (with file descriptors,
        # fetched from the sender, a worker would need its trainer's help to read them)
        torch.multiprocessing.set_sharing_strategy("file_system")
        ctx = torch.multiprocessing.get_context("spawn")
        self.spool = make_spool()
        self.closing = ctx.Event()  # set by close(): workers then honour SIGTERM
        requests = [ctx.Pipe(duplex=False) for _ in range(n)]  # (the worker's read end, our write end)
        results = [ctx.Pipe(duplex=False) for _ in range(n)]  # (our read end, the worker's write end)
        self.procs = [ctx.Process(target=target, name=f"gspo-rollout-worker-{i}", daemon=True,
                                  args=(*args_of(i), ProcessEnd(i, requests[i][0], results[i][1], str(self.spool),
                                                                self.closing, os.getpid())))
                      for i in range(n)]
        atexit.register(self.close)  # before multiprocessing's exit, which joins its children without a deadline
        for p in self.procs:
            p.start()
        for end in [r for r, _ in requests] + [w for _, w in results]:
            end.close()  # each worker holds the only copy of its ends
        self.senders = [_Sender(w, mine) for w, (_, mine) in enumerate(requests)]
        self.results: list = [mine for mine, _ in results]
        self.sender = True  # this process sends the requests

    def send(self, w: int, msg) -> None:
        self.senders[w].put(msg)

    def recv(self, timeout: float):
        """The next worker message, or None after `timeout` seconds without one. A message is
        whole when it is seen (one small write), so reading it never waits on its sender."""
        live = [c for c in self.results if c is not None]
        if not live:
            time.sleep(timeout)
            return None
        for conn in multiprocessing.connection.wait(live, timeout):
            try:
                raw = conn.recv_bytes()
            except (EOFError, OSError):  # the worker's end closed: it exited or died (check() says which)
                self.results[self.results.index(conn)] = None
                continue
            return _open(raw)
        return None

    def check(self) -> None:
        for w, p in enumerate(self.procs):
            if not p.is_alive():
                code = p.exitcode
                killed = code is not None and code < 0
                how = f"killed by {signal.Signals(-code).name}" if killed else f"exit code {code}"
                raise WorkerDied(w, how, p.pid)

    def close(self) -> None:
        """Stop the workers, escalating (stop request, SIGTERM, SIGKILL), whatever interrupts this."""
        atexit.unregister(self.close)
        if not self.procs:
            return
        try:
            self.closing.set()
            for s in self.senders:
                s.put(("stop",), last=True)
            _join(self.procs, CLOSE_STOP_S)
            for p in self.procs:
                if p.is_alive():
                    p.terminate()  # honoured: `closing` is set
            _join(self.procs, CLOSE_TERM_S)
        finally:
            for p in self.procs:
                if p.is_alive():
                    p.kill()
            _join(self.procs, 1.0)
            for s in self.senders:  # the workers are gone: a write to them fails at once
                s.close()
            for c in self.results:
                if c is not None:
                    c.close()
            remove_spool(self.spool)
            self.procs, self.senders, self.results = [], [], []


def _join(procs, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))


class _Sender:
    """The requests to one worker, pickled (tensors into shared memory) and written by a thread of
    their own, so that the trainer never waits for a worker busy sampling. Unlike a
    multiprocessing queue's feeder thread, it is told to stop and joined (close): a daemon thread
    still pickling a tensor when the interpreter finalizes aborts the process."""

    def __init__(self, w: int, conn):
        self.conn, self.pending, self.stopped = conn, queue.SimpleQueue(), False
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"gspo-requests-{w}")
        self.thread.start()

    def put(self, msg, last: bool = False) -> None:
        self.pending.put(msg)
        if last:
            self.pending.put(None)

    def _run(self) -> None:
        while (msg := self.pending.get()) is not None and not self.stopped:
            try:
                self.conn.send_bytes(ForkingPickler.dumps(msg))
            except OSError:  # the worker is gone (a broken pipe): the trainer's check says so
                return

    def close(self) -> None:
        self.stopped = True  # what is still pending is not sent
        self.pending.put(None)
        self.thread.join(timeout=CLOSE_TERM_S)
        self.conn.close()


def _open(raw: bytes):
    """A message from its wire form: inline (b"I" + pickle) or the name of its spool file (b"F" + path)."""
    if raw[:1] == b"I":
        return pickle.loads(raw[1:])
    path = Path(raw[1:].decode())
    try:
        data = path.read_bytes()
    finally:
        path.unlink(missing_ok=True)
    return pickle.loads(data)


class ProcessEnd:
    """A worker process's end of a LocalLink (made in the trainer's process, used in the worker's)."""

    def __init__(self, index: int, requests, results, spool: str, closing, parent: int):
        self.index, self.requests, self.results, self.spool = index, requests, results, Path(spool)
        self.closing, self.parent, self.sent = closing, parent, 0

    def start(self) -> None:
        """In the worker: die with the trainer, ignore SIGINT, honour SIGTERM when the trainer closes."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self._sigterm)
        if not on_parent_death(signal.SIGKILL):
            threading.Thread(target=self._watch, daemon=True, name="gspo-parent-watch").start()
        if self.orphaned():  # the trainer died before the kernel was asked to tell us
            os._exit(1)

    def orphaned(self) -> bool:
        return os.getppid() != self.parent

    def _watch(self) -> None:
        while not self.orphaned():
            time.sleep(WATCH_S)
        os._exit(1)

    def _sigterm(self, signum, frame) -> None:
        if self.closing.is_set() or self.orphaned():
            os._exit(1 if self.orphaned() else 0)
        # else a signal to the whole process group: the trainer answers it (checkpoint, then stop)

    def next(self, timeout: float):
        """The next request; None after `timeout` seconds without one; ("stop",) once the trainer is gone."""
        if not self.requests.poll(timeout):
            return ("stop",) if self.orphaned() else None
        try:
            return pickle.loads(self.requests.recv_bytes())
        except (EOFError, OSError):  # the trainer's end closed
            return ("stop",)

    def put(self, msg, dest=None) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) < INLINE_BYTES:
            self.results.send_bytes(b"I" + data)
            return
        self.sent += 1
        path = self.spool / f"worker{self.index}-{self.sent}.pkl"
        part = path.with_suffix(".part")
        try:
            part.write_bytes(data)
            os.replace(part, path)  # complete before it is announced
        except OSError as e:
            part.unlink(missing_ok=True)
            raise OSError(f"could not spool a {len(data) / 2**20:.1f} MB result in {self.spool} ({e.strerror or e}); "
                          "set GSPO_SPOOL_DIR to a directory with room") from None
        self.results.send_bytes(b"F" + str(path).encode())


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
        deadline = time.monotonic() + CLOSE_STOP_S + CLOSE_TERM_S  # each rank's "bye"; a rank mid-batch is torchrun's
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))


class RankEnd:
    """A rollout rank's end: requests from trainer rank 0, results to each trainer process."""

    def __init__(self, group, trainers: int):
        self.group, self.trainers, self.gone = group, trainers, False
        self.inbox: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._listen, daemon=True, name="gspo-rollout-requests")
        self.thread.start()

    def start(self) -> None:
        """In the rank: ignore SIGINT (the trainers answer it), honour SIGTERM once trainer rank 0
        is gone (before that, torchrun's SIGTERM is also the trainers', which checkpoint with the
        batches in flight and then stop this rank)."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(1) if self.gone else None)

    def _listen(self) -> None:
        while True:
            try:
                msg = _recv(0, self.group)
            except Exception:  # trainer rank 0 is gone: leave, mid-batch or not
                self.gone = True
                self.inbox.put(("stop",))
                threading.Timer(GONE_GRACE_S, os._exit, (1,)).start()
                return
            self.inbox.put(msg)
            if msg[0] == "stop":
                return

    def next(self, timeout: float):
        return _get(self.inbox, timeout)

    def put(self, msg, dest: int) -> None:
        _send(msg, dest, self.group)

    def close(self) -> None:
        """Say goodbye to each trainer process, rank 0 last: its goodbye lets it leave, and with it
        (their barrier) the others. A trainer that stopped waiting for its goodbye (it waits
        CLOSE_STOP_S + CLOSE_TERM_S from its own close, and rank 0 may come far later, writing the
        final checkpoint) may be gone: the run is over, and that is no failure of this rank."""
        if self.gone:  # no one to say goodbye to
            return
        for r in reversed(range(self.trainers)):
            try:
                _send(("bye",), r, self.group)
            except Exception:  # noqa: BLE001 (its connection closed: it has left)
                pass
