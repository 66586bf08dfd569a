"""Rollouts on vLLM's own inference server: `vllm serve` as a service, driven over HTTP so it cannot hang a run.

    gspo train --rollout-engine vllm-server                                   # gspo starts one here, and stops it
    VLLM_API_KEY=... gspo train --rollout-engine vllm-server \\
        --vllm-server-url http://10.0.0.5:8000 --vllm-server-url http://10.0.0.6:8000   # the user's servers

    sampler = ServerSampler(servers, options, dtype="float32", push=DirectoryPush(...))
    sampler.sync(policy)                 # the policy's current weights on every server (skipped where held)
    ro = sampler.sample(prompt_ids, params, generator=g)   # a Rollout, as the colocated engine's
    sampler.close()                      # a server gspo started is stopped (its whole process group)

It implements the `gspo.sampling.rollout.Sampler` interface (sync, sample, end_rollout) as the
colocated engine does (gspo.sampling.vllm_engine), over vLLM's OpenAI-compatible API:

- **Token-exact.** Each prompt is one `/v1/completions` request: its token ids as the prompt,
  `n` = the group size, one seed per prompt drawn from the step's generator (as the colocated
  engine: a completion does not depend on how the batch is split), the stop-token set,
  `return_token_ids` and `logprobs: 0` (the sampled token's log-prob). The server must run
  in `processed_logprobs` mode (log softmax(logits / tau), the trainer's distribution): a server
  that does not is caught by the sync check below at any temperature but 1, and by the
  integrity check at every step. Requests are spread over the servers, prompt i on server
  i mod M, concurrently.
- **Weight sync through vLLM's API** (`push`): before a rollout whose weights the servers do not
  hold yet. Generation is paused (`/pause?mode=wait`: in-flight requests finish first), the
  weights go over, the prefix cache is reset, `/update_weight_version` tags the server with the
  run and the version (`<run-id>:<version>`), generation resumes. Two ways over:
  DirectoryPush (`/collective_rpc` with vLLM's `reload_weights(weights_path=...)`: the weights
  written as safetensors shards to a directory the server reads; CPU, laptops, one machine or
  a shared filesystem) and NcclPush (vLLM's NCCL weight-transfer engine: GPUs, across nodes;
  gspo.sampling.server_nccl).
- **Samples and syncs in two threads** (--max-staleness K >= 1: gspo.sampling.pipeline.ServerPipeline
  samples while the trainer trains): they meet at a `Gate`. A sync closes it, lets this run's
  requests under way end (or, with --partial-rollouts, aborts them: `/pause?mode=abort`, and
  cuts what a paused server holds), pushes, and opens it with the new version; every request
  knows the one version that answered it, and an aborted completion continues under the new
  weights, each token carrying its version (`Rollout.versions`).
- **Versions.** Every server is asked for its weight version before each rollout: a server that
  restarted reports vLLM's "default" and is health-checked and re-synced before it samples.
  A resumed run syncs before it samples (a new sampler holds no version).
- **Deadlines on everything.** Each request, probe and sync has a deadline
  (`--vllm-server-timeout`, `--vllm-server-sync-timeout`, `--vllm-server-start-timeout`); a
  server that is down, slow or gone is a ServerError: one line naming the server, what it was
  asked and the deadline (the CLI: exit 2, and `gspo train --resume RUN` continues from the
  last checkpoint).
- **The sync check** (`--vllm-check-weight-sync`, on by default): after each sync, every server
  samples 8 tokens of a fixed prompt at the run's temperature and their log-probs are compared
  with the trainer's forward of the same tokens; a gap past the dtype's bound is a ServerError
  (wrong weights, another model, raw log-probs).

What is checked before step 1 (`connect`): each URL is well formed and answers `/health` within
the deadline; `/v1/models` with the key names the model and its max_model_len; the dev routes
(`/weight_info`) answer (the server runs with VLLM_SERVER_DEV_MODE=1); the served model is this
run's (its name, or its directory's) and holds the run's longest prompt + completion.

Security: vLLM checks the API key (`--api-key`, or VLLM_API_KEY) on /v1 routes only; the dev
routes that pause a server and replace its weights answer anyone who reaches them. A server gspo
starts listens on 127.0.0.1 only, with a random key passed in its environment (not on a command
line `ps` shows); a user's key comes from VLLM_API_KEY, never a flag (docs/server.md).
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import CancelledError, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gspo.config.checks import one_line
from gspo.io.http import BadAddress, HTTPFailed, exchange, server_base
from gspo.models.sequences import Rollout
from gspo.sampling.rollout import SamplingParams
from gspo.sampling.vllm_engine import checkpoint_weights, rollout_from

KEY_VARIABLE = "VLLM_API_KEY"  # the variable vLLM's server reads its key from, and gspo a user's key
CHECK_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]  # the sync check's prompt (token ids every vocabulary has)
CHECK_TOKENS = 8
SHARD_BYTES = 1 << 30
LOGP_SLACK = 1e-5  # a sampled token's log-prob is <= 0; float rounding may put log 1 a hair above


class ServerError(ValueError):
    """A server that is down, slow, restarted or wrong: one line naming it, what it was asked and the deadline."""


@dataclass(frozen=True)
class Deadlines:
    request: float = 300.0  # one prompt's group of completions (or one probe)
    sync: float = 300.0  # one weight sync, every server
    start: float = 600.0  # a server gspo starts: until it answers /health


@dataclass
class Server:
    """One vLLM server: where it is, the key its /v1 routes want, and what it said of itself."""

    url: str
    key: str | None = None
    model: str = ""  # the model id /v1/models names
    max_model_len: int = 0
    version: str = ""  # vLLM's version
    weights: str | None = None  # the weight version it holds ("<run>:<version>"), as last seen
    device: str = ""  # where it computes (its vllm_config's device_config: cpu, cuda)

    def __post_init__(self):
        try:
            self.url = server_base(self.url, ("",))
        except BadAddress as e:
            if e.port:
                raise ServerError(f"vllm_server_url: {self.url!r} has an invalid port") from None
            raise ServerError(f"vllm_server_url: {self.url!r} is not a server's address; expected http://HOST:PORT "
                              "(no path: gspo calls /v1/completions and vLLM's routes itself)") from None

    def call(self, path: str, body: dict | None = None, *, timeout: float, what: str | None = None,
             ticket: Ticket | None = None):
        """The JSON answer of one request (POST with a body, else GET), within `timeout` seconds;
        ServerError otherwise. ticket: its place at a sampler's gate (a sync may cut it: NotStarted)."""
        what = what or path
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        try:
            status, raw = exchange(self.url, path, body, headers=headers, timeout=timeout,
                                   on_connect=ticket.attach if ticket is not None else None)  # NotStarted if cut
        except HTTPFailed as e:
            if ticket is not None and ticket.cancelled:
                raise NotStarted from None
            if not e.late:
                raise ServerError(f"vLLM server {self.url}: {what} failed ({_reason(e.cause)})") from None
            raise ServerError(f"vLLM server {self.url}: no answer to {what} within {timeout:g} s "
                              "(--vllm-server-timeout / --vllm-server-sync-timeout)") from None
        if status == 401:
            raise ServerError(f"vLLM server {self.url}: {what} refused the API key (401); give the server's key in "
                              f"{KEY_VARIABLE}")
        if status == 404 and not path.startswith("/v1"):
            raise ServerError(f"vLLM server {self.url}: {what} is not there (404); gspo drives vLLM's dev routes: "
                              "start the server with VLLM_SERVER_DEV_MODE=1 (docs/server.md)")
        if status != 200:
            raise ServerError(f"vLLM server {self.url}: {what} answered {status} "
                              f"({' '.join(raw.decode(errors='replace').split())[:200]})")
        try:
            return json.loads(raw) if raw else None
        except json.JSONDecodeError:
            raise ServerError(f"vLLM server {self.url}: {what} answered something that is not JSON "
                              f"({raw[:80]!r})") from None


def _reason(e: BaseException) -> str:
    """An error in a ServerError's parenthesis: its message on one line (its type where it has none), cut."""
    return (one_line(e) or type(e).__name__)[:200]


def servers_from(urls, key: str | None = None) -> list[Server]:
    """Server objects for the URLs (their key: `key`, else VLLM_API_KEY); a repeated URL is refused."""
    key = key if key is not None else os.environ.get(KEY_VARIABLE) or None
    servers = [Server(u, key) for u in urls]
    seen = set()
    for s in servers:
        if s.url in seen:
            raise ServerError(f"vllm_server_url: {s.url} is given twice")
        seen.add(s.url)
    return servers


def connect(servers: list[Server], *, model: str, needed_len: int, deadlines: Deadlines,
            served_dir: str | None = None) -> None:
    """Check every server before step 1: it answers, has the dev routes, serves this run's model (named
    as the run names it, or its directory `served_dir`) and holds `needed_len` tokens. Fills in each
    Server's facts."""
    for s in servers:
        probe(s, deadlines.request)
        if not (same_model(s.model, model) or (served_dir is not None and same_model(s.model, served_dir))):
            raise ServerError(f"vLLM server {s.url} serves {s.model!r}, and this run trains {model!r}; start it with "
                              f"this model (or --served-model-name {Path(str(model)).name})")
        if s.max_model_len and s.max_model_len < needed_len:
            raise ServerError(f"vLLM server {s.url}: max_model_len {s.max_model_len} is shorter than this run's "
                              f"longest prompt + completion ({needed_len} tokens); start it with --max-model-len "
                              f"{needed_len} or more")


def probe(s: Server, timeout: float, deadline: float | None = None, total: float | None = None) -> None:
    """Ask a server what it is: healthy, its vLLM version, model, length, weight tag and device. Each
    call within `timeout` seconds; all of them before `deadline` (time.monotonic(); a sync's, whose
    length is `total` seconds) when given."""
    def within(path: str):
        if deadline is None:
            return s.call(path, timeout=timeout, what=path) or {}
        return _sync_call(s, path, None, deadline, total or timeout, cap=timeout) or {}

    within("/health")
    s.version = str(within("/version").get("version", "?"))
    models = within("/v1/models").get("data") or []
    if not models:
        raise ServerError(f"vLLM server {s.url}: /v1/models lists no model")
    s.model = str(models[0].get("id", ""))
    s.max_model_len = int(models[0].get("max_model_len") or 0)
    s.weights = str(within("/weight_info").get("weight_version"))
    config = str(within("/server_info").get("vllm_config", ""))
    found = re.search(r"device_config=(\w+)", config)
    s.device = found.group(1) if found else ""


def same_model(served: str, model: str) -> bool:
    """Whether a server's model id names this run's model: the same id, the same directory, or a
    directory of the same name (a server started elsewhere with the model's path there)."""
    a, b = str(served).rstrip("/"), str(model).rstrip("/")
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    try:
        if pa.exists() and pb.exists() and pa.resolve() == pb.resolve():
            return True
    except OSError:
        pass
    return pa.name == pb.name and bool(pa.name)


# --- weight pushes -----------------------------------------------------------------------------


class DirectoryPush:
    """Weights through a directory the servers read: the policy's (name, tensor) pairs written as
    safetensors shards (~1 GiB each, one tensor in memory at a time beyond the shard being
    written), then each server reloads them in place with vLLM's own `reload_weights`
    (`/collective_rpc`); the previous version's directory is removed after."""

    name = "directory"

    def __init__(self, root: Path, dtype: torch.dtype):
        self.root, self.dtype = Path(root), dtype
        self.current: Path | None = None

    def push(self, policy, servers: list[Server], tag: str, timeout: float, deadline: float) -> None:
        from safetensors.torch import save_file

        target = self.root / tag.replace(":", "-")
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        shard, size, n = {}, 0, 0
        for name, tensor in checkpoint_weights(policy, self.dtype):
            value = tensor.detach().to("cpu").contiguous()
            if any(value.data_ptr() == v.data_ptr() for v in shard.values()):  # a tied weight's second name
                value = value.clone()
            shard[name] = value
            size += tensor.numel() * tensor.element_size()
            if size >= SHARD_BYTES:
                save_file(shard, str(target / f"model-{n:05d}.safetensors"))
                shard, size, n = {}, 0, n + 1
        if shard or n == 0:
            save_file(shard, str(target / f"model-{n:05d}.safetensors"))
        for s in servers:
            s.call("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(target.absolute())}},
                   timeout=_left(deadline, s, timeout), what="the weight sync (/collective_rpc reload_weights)")
        if self.current is not None and self.current != target:
            shutil.rmtree(self.current, ignore_errors=True)
        self.current = target

    def close(self) -> None:
        if self.current is not None:
            shutil.rmtree(self.current, ignore_errors=True)
            self.current = None


class NotStarted(Exception):
    """A request a weight sync kept from starting, or cut while the paused server held it unanswered:
    nothing it may have sampled is taken; it is asked again under the new weights."""


class Ticket:
    """One request's place at the gate: its socket, for a sync to cut (`Gate.cut`)."""

    def __init__(self, gate: Gate):
        self.gate, self.sock, self.cancelled = gate, None, False

    def attach(self, sock) -> None:
        """The request's socket is connected: from here a cut shuts it. Raises NotStarted if cut already."""
        with self.gate.cond:
            if self.cancelled:
                raise NotStarted
            self.sock = sock


class Gate:
    """Who may use the servers' weights now: samples (readers, many at once) or a weight sync (the
    writer, alone). A sample holds it for a round of requests and reads the version there; a sync
    closes it, pauses the servers, waits for the rounds under way, pushes, and opens it with the new
    version. A sync waiting takes precedence over samples arriving.

    Exactness: every request takes a ticket before it is sent, and none is given while the gate is
    closed. A request whose ticket came just before the sync closed it can reach the server after
    the pause, which then holds it unanswered until /resume (vLLM queues what arrives while paused):
    the sync waits a moment for the rounds under way, then cuts the requests still unanswered
    (`cut`), which are asked again after the sync (NotStarted). So every answer a sample takes was
    computed before the push (its round ended before the push began), and whatever was not answered
    by then is sampled again under the new weights, and marked with them."""

    GRACE = 0.25  # seconds after an aborting pause for the answers under way to arrive, before the rest are cut

    def __init__(self):
        self.cond = threading.Condition()
        self.readers = 0
        self.closed = False  # a sync is under way or waiting: no new sample, no new request starts
        self.version: int | None = None  # the policy version the servers hold (None: unknown, none pushed)
        self.syncs = 0  # syncs begun: a generation aborted while one was under way was aborted by it
        self.broken: str | None = None  # a sync failed: the servers' weights are unknown, nothing samples on
        self.shut: str | None = None  # the sampler was closed: for good (a sync ending after it does not reopen)
        self.tickets: set[Ticket] = set()

    def enter(self, timeout: float) -> tuple[int | None, int]:
        """A sample starts: (the version it samples with, the syncs begun so far)."""
        with self.cond:
            if not self.cond.wait_for(lambda: not self.closed, timeout):
                raise ServerError(f"no weight sync ended within {timeout:g} s (--vllm-server-sync-timeout) while a "
                                  "sample waited for it")
            if self.broken:
                raise ServerError(self.broken)
            self.readers += 1
            return self.version, self.syncs

    def leave(self) -> None:
        with self.cond:
            self.readers -= 1
            self.cond.notify_all()

    def ticket(self) -> Ticket:
        """A request of a round under way may start: its ticket. NotStarted when a sync closed the gate."""
        with self.cond:
            if self.closed or self.broken:
                raise NotStarted
            t = Ticket(self)
            self.tickets.add(t)
            return t

    def done(self, ticket: Ticket) -> None:
        with self.cond:
            self.tickets.discard(ticket)

    def close(self) -> None:
        """A sync begins: no new sample or request starts from here on."""
        with self.cond:
            self.closed = True
            self.syncs += 1

    def drain(self, timeout: float, cut: bool = False) -> None:
        """Wait for the rounds under way to end. cut (after the servers paused): GRACE seconds for their
        answers, then the requests still unanswered are cut (a paused server holds them) and their
        rounds end at once."""
        end = time.monotonic() + timeout
        with self.cond:
            if cut and not self.cond.wait_for(lambda: self.readers == 0, min(self.GRACE, timeout)):
                self.cut()
            if not self.cond.wait_for(lambda: self.readers == 0, max(0.0, end - time.monotonic())):
                raise ServerError(f"the generations under way did not end within {timeout:g} s of a weight sync's "
                                  "start (--vllm-server-timeout)")

    def cut(self) -> None:
        """Cancel every request with a ticket: shut its socket (its call raises NotStarted)."""
        with self.cond:
            for t in self.tickets:
                t.cancelled = True
                if t.sock is not None:
                    try:
                        t.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

    def open(self, version: int | None, broken: str | None = None) -> None:
        """The sync ended: samples go on with `version`; `broken`: it failed, and every sample raises it."""
        with self.cond:
            self.closed, self.version, self.broken = False, version, broken or self.shut
            self.cond.notify_all()

    def close_for_good(self, reason: str) -> None:
        """The sampler is closed: every sample waiting or to come raises `reason`, every request is cut."""
        with self.cond:
            self.shut = reason
        self.open(None)
        self.cut()


# --- the sampler -------------------------------------------------------------------------------


@dataclass
class ServerSampler:
    """vLLM servers behind the gspo.sampling.rollout.Sampler interface (see the module docstring).

    run_id: tags the servers' weight versions (a server another run synced is re-synced).
    check: a callable(policy, prompt, ids, server_logps) -> (breach, gap, bound) run after each sync on
    every synced server (the sync check, gspo.sampling.samplers.sync_check; None: off).
    dist: under torchrun every process samples its share; rank 0 pushes the weights."""

    servers: list[Server]
    push: object
    deadlines: Deadlines
    run_id: str
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    check: object = None
    temperature: float = 1.0
    dist: object = None
    owned: object = None  # an OwnedServer gspo started: stopped by close()
    scratch: Path | None = None  # a directory of this sampler's own (pushed weights, a started server's log): removed
    pushed_version: int | None = None  # the policy version of the last push (None: unknown, always pushed)
    tag: str | None = None  # the tag of the last push ("<run>:<n>")
    pushes: int = 0
    sync_seconds: float = 0.0  # the last push's
    max_model_len: int = 0
    vocab_size: int = 0
    last_check: dict = field(default_factory=dict)  # the sync check's figures: server -> max |delta log p|
    # --partial-rollouts: a sync aborts the generations under way (/pause?mode=abort), and each continues under
    # the new weights from where it stopped (its tokens so far as the prompt's tail); off: a sync waits for them
    partial: bool = False
    gate: Gate = field(default_factory=Gate)  # samples against syncs (a sync may come from another thread)
    continued: int = 0  # generations continued across a sync (partial rollouts), over the run
    _pool: ThreadPoolExecutor | None = None

    # --- the Sampler interface ---

    def sync(self, policy, version: int | None = None) -> None:
        """Every server holds `policy`'s current weights when this returns. The push is skipped only
        where a server already holds them: `version` (the policy version, the steps done) is the
        last push's and the server still carries that push's tag. A server that restarted (vLLM's
        "default" tag) is probed, then pushed to; one that something else synced is pushed to."""
        if self.gate.shut:
            raise ServerError(self.gate.shut)
        main = self.dist is None or self.dist.is_main
        changed = version is None or version != self.pushed_version
        tag = f"{self.run_id}:{self.pushes + 1}" if changed else self.tag
        stale = []  # the indices of the servers to push to: rank 0 asks them, every rank knows
        if main:
            for i, s in enumerate(self.servers):
                s.weights = self._tag_of(s)
                if changed or s.weights != self.tag:
                    stale.append(i)
        if self.dist is not None and self.dist.enabled:  # every rank joins the push's gathers (FSDP), or none does
            stale = self.dist.broadcast_object(stale)
        if not stale:
            return
        servers = [self.servers[i] for i in stale]
        t0 = time.perf_counter()
        self.gate.close()  # no sample starts until the new weights are in (one may be under way: another thread's)
        try:
            if main:
                self._push_to(servers, policy, tag)
            else:  # the other ranks take part in the gathers of the weights rank 0 sends
                for _ in checkpoint_weights(policy, getattr(self.push, "dtype", None)):
                    pass
            self.pushed_version, self.tag, self.pushes = version, tag, self.pushes + (1 if changed else 0)
            self.sync_seconds = time.perf_counter() - t0
            if self.check is not None:  # on every rank: the trainer's forward may be collective (FSDP)
                self._check(policy, servers)
        except BaseException as e:  # the servers' weights are unknown: a sample waiting, or to come, raises
            self.gate.open(None, broken=f"a weight sync failed ({_reason(e)}); nothing samples on these servers")
            raise
        self.gate.open(version)
        if self.dist is not None and self.dist.enabled:
            self.dist.barrier()

    def _push_to(self, stale: list[Server], policy, tag: str) -> None:
        """Rank 0's part of a sync: probe the restarted, pause, tag pending, push, see the pending tag is
        still there, reset the prefix cache, tag, and resume every server paused, whatever failed."""
        deadline, total = time.monotonic() + self.deadlines.sync, self.deadlines.sync
        paused = []
        try:
            for s in stale:
                if s.weights in (None, "None", "default"):  # a fresh (or restarted) server: checked first
                    probe(s, self.deadlines.request, deadline, total)
            drain = min(self.deadlines.request, max(0.0, deadline - time.monotonic()))
            if not self.partial:  # this run's generations under way end first, while the servers still serve
                self.gate.drain(drain)
            mode = "abort" if self.partial else "wait"  # abort: the generations under way continue after the sync
            for s in stale:
                paused.append(s)  # a /pause that fails midway may have paused it: resumed below all the same
                _sync_call(s, f"/pause?mode={mode}", {}, deadline, total)
            if self.partial:  # their answers (aborted) in; a request the paused server holds is cut, asked again
                self.gate.drain(drain, cut=True)
            for s in stale:  # a pending tag first: a sync by someone else meanwhile replaces it, and is seen below
                _sync_call(s, "/update_weight_version", {"new_version": f"{tag}.pending"}, deadline, total)
            self.push.push(policy, stale, tag, total, deadline)
            for s in stale:
                _left(deadline, s, total)
                if (now := self._tag_of(s)) != f"{tag}.pending":
                    raise ServerError(f"vLLM server {s.url}: something else synced it during this run's weight "
                                      f"sync (it now holds {now!r}): two runs on one server? Give each run its "
                                      "own servers")
                _sync_call(s, "/reset_prefix_cache", {}, deadline, total)
                _sync_call(s, "/update_weight_version", {"new_version": tag}, deadline, total)
                s.weights = tag
        finally:
            for s in paused:
                try:  # bounded: a dead server costs at most a few seconds here, on top of the error said
                    s.call("/resume", {}, timeout=min(self.deadlines.request, 5.0), what="/resume")
                except ServerError:
                    pass  # the error that brought us here says more

    def _tag_of(self, s: Server) -> str:
        return str((s.call("/weight_info", timeout=self.deadlines.request) or {}).get("weight_version"))

    def verify(self) -> None:
        """After a rollout: every server still holds the weights it was synced with (a server that
        restarted mid-rollout came back with its checkpoint's, and sampled from them)."""
        for s in self.servers:
            now = self._tag_of(s)
            if now != self.tag:
                raise ServerError(f"vLLM server {s.url}: its weights changed during the rollout (it holds {now!r}, "
                                  f"synced {self.tag!r}): it restarted or something else synced it; this batch is not "
                                  "the policy's")

    def sample(self, prompts: list[list[int]], params: SamplingParams, *, generator: torch.Generator | None = None,
               rows: tuple[int, int] | None = None) -> Rollout:
        G = params.group_size
        offset, total = rows or (0, len(prompts) * G)
        # rows: this process's share of the batch, from row `offset` on, or (an episode's later turns, an agent's
        # calls) a tensor of the batch rows these prompts are, one per prompt times G
        index = (list(range(offset // G, offset // G + len(prompts))) if isinstance(offset, int)
                 else [int(r) // G for r in torch.as_tensor(offset).reshape(-1)])
        seeds = torch.randint(0, 2**31 - 1, (total // G,), generator=generator)[index].tolist()
        # the batch's prompt i goes to server i mod M: the same split on every rank
        servers = [self.servers[i % len(self.servers)] for i in index]
        version, seen = self._enter()
        try:
            answers = self._map(lambda job: self._ask(*job, params), zip(servers, prompts, seeds))
            self.verify()
        finally:
            self.gate.leave()
        # each completion: [ids, log-probs, the version of each token, finish reason]; a request a sync kept from
        # starting (or cut) is G completions with nothing yet, continued like an aborted one
        answers = [a if a is not None else [([], [], "abort")] * G for a in answers]
        outs = [[ids, lps, [version] * len(ids), finish] for choices in answers for ids, lps, finish in choices]
        while todo := [k for k, o in enumerate(outs) if o[3] == "abort"]:  # partial rollouts: continue them
            if self.gate.broken:  # a sync failed, or the sampler was closed
                raise ServerError(self.gate.broken)
            if self.gate.syncs == seen:
                raise ServerError(f"vLLM server {servers[todo[0] // G].url}: it aborted a generation while no weight "
                                  "sync of this run was under way (another client paused it, or it is shutting down)")
            version, seen = self._enter()
            try:
                more = self._map(
                    lambda k: self._continue(servers[k // G], prompts[k // G], outs[k], params, seeds[k // G], k % G),
                    todo)
                self.verify()
            finally:
                self.gate.leave()
            self.continued += len(todo)
            for k, (ids, lps, finish) in zip(todo, more):
                o = outs[k]
                o[0], o[1], o[2], o[3] = o[0] + ids, o[1] + lps, o[2] + [version] * len(ids), finish
        seqs, logps, versions = [o[0] for o in outs], [o[1] for o in outs], [o[2] for o in outs]
        if any(v is None for vs in versions for v in vs):  # a round at an unknown version (a sync without one)
            version = None  # no per-token versions: the caller's own labels, as for any sampler
        ro = rollout_from(prompts, seqs, logps, [o[3] == "length" for o in outs], params, self.device)
        if version is not None:  # each token's version (-1 on padding): Rollout.versions
            ro.versions = torch.full(ro.completion_ids.shape, -1, dtype=torch.int32)
            for i, v in enumerate(versions):
                ro.versions[i, :len(v)] = torch.tensor(v, dtype=torch.int32)
            ro.versions = ro.versions.to(self.device)
        return ro

    def _ask(self, server: Server, prompt: list[int], seed: int, params: SamplingParams):
        """A sample's request, with its ticket at the gate: its completions, or None (NotStarted: a sync came)."""
        try:
            ticket = self.gate.ticket()
        except NotStarted:
            return None
        try:
            return self._complete(server, prompt, params, seed, ticket=ticket)
        except NotStarted:
            return None
        finally:
            self.gate.done(ticket)

    def _map(self, fn, items) -> list:
        """fn over items on the request pool; a pool shut by close() is the gate's one line."""
        try:
            return list(self._executor().map(fn, items))
        except CancelledError:
            raise ServerError(self.gate.shut or self.gate.broken or "the sampler was closed") from None

    def _enter(self) -> tuple[int | None, int]:
        """A sample's turn at the servers: waits for a sync under way (bounded by its deadline)."""
        return self.gate.enter(self.deadlines.sync + self.deadlines.request)

    def _continue(self, server: Server, prompt: list[int], out: list, params: SamplingParams, seed: int,
                  g: int) -> tuple[list[int], list[float], str]:
        """Completion g of `prompt`, aborted by a sync after the tokens `out` holds, continued under the
        new weights: its tokens so far become the prompt's tail (token-exact), the budget what is left."""
        ids = out[0]
        if ids and ids[-1] in params.stop_token_ids and len(ids) >= params.min_new_tokens:
            return [], [], "stop"  # aborted just as it ended
        if len(ids) >= params.max_new_tokens:
            return [], [], "length"
        rest = dataclasses.replace(params, group_size=1, max_new_tokens=params.max_new_tokens - len(ids),
                                   min_new_tokens=max(0, params.min_new_tokens - len(ids)))
        # a seed of its own (the first part's seed would replay the first part's uniforms)
        seed = int.from_bytes(hashlib.sha256(f"{seed}-{g}-{len(ids)}".encode()).digest()[:4], "little") & (2**31 - 1)
        got = self._ask(server, list(prompt) + ids, seed, rest)
        return got[0] if got is not None else ([], [], "abort")  # None: a sync came first; asked again after it

    def end_rollout(self) -> None:
        """Nothing to free: the servers keep their memory (another process's, or another machine's)."""

    def close(self) -> None:
        # a sampling thread's requests end now, not at their deadline (the interpreter joins that thread at exit),
        # and a sample waiting at the gate, or still to come, raises
        self.gate.close_for_good("the sampler was closed (the run is ending)")
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self.owned is not None:
            self.owned.stop()
            self.owned = None
        close = getattr(self.push, "close", None)
        if close is not None:
            close()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    # --- the pieces ---

    def _executor(self) -> ThreadPoolExecutor:
        if self.gate.shut:  # closed: no new pool, no thread that outlives close()
            raise ServerError(self.gate.shut)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="gspo-vllm-server")
        return self._pool

    def _complete(self, server: Server, prompt: list[int], params: SamplingParams, seed: int,
                  ignore_eos: bool = False, ticket: Ticket | None = None) -> list[tuple[list[int], list[float], str]]:
        """params.group_size completions of `prompt` (the request's n)."""
        body = {"model": server.model, "prompt": list(prompt), "n": params.group_size,
                "max_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
                "top_k": params.top_k if params.top_k > 0 else -1, "min_tokens": params.min_new_tokens,
                "stop_token_ids": list(params.stop_token_ids), "seed": seed, "logprobs": 0,
                "return_token_ids": True, "return_tokens_as_token_ids": True, "skip_special_tokens": False,
                "ignore_eos": ignore_eos, "include_stop_str_in_output": True}
        answer = server.call("/v1/completions", body, timeout=self.deadlines.request, ticket=ticket,
                             what=f"a completion request ({len(prompt)} prompt tokens, n={body['n']})")
        choices = (answer or {}).get("choices") or []
        if sorted(c.get("index", -1) if isinstance(c, dict) else -1 for c in choices) != list(range(body["n"])):
            raise ServerError(f"vLLM server {server.url}: asked for {body['n']} completions, got "
                              f"{len(choices)} whose indices are not 0..{body['n'] - 1} once each")
        return [self._choice(server, c, params) for c in sorted(choices, key=lambda c: c["index"])]

    def _choice(self, server: Server, c: dict, params: SamplingParams) -> tuple[list[int], list[float], str]:
        """One completion of a server's answer, checked: whatever a batch takes from a server must be a
        sample of the policy (token ids in the vocabulary, finite log-probs <= 0, at most max_tokens,
        ended by a stop token or by the length limit)."""
        ids, lps = c.get("token_ids"), (c.get("logprobs") or {}).get("token_logprobs")
        bad = None
        if not isinstance(ids, list) or not isinstance(lps, list) or len(ids) != len(lps):
            bad = "came without its token ids and log-probs (gspo needs vLLM >= 0.10.2's return_token_ids)"
        elif not all(isinstance(t, int) and 0 <= t < (self.vocab_size or 2**62) for t in ids):
            bad = f"holds a token id outside the vocabulary (0..{self.vocab_size - 1})"
        elif not all(isinstance(lp, (int, float)) and math.isfinite(lp) and lp <= LOGP_SLACK for lp in lps):
            bad = "holds a log-prob that is missing, not finite or above 0"
        elif len(ids) > params.max_new_tokens:
            bad = f"is longer ({len(ids)} tokens) than the {params.max_new_tokens} asked for"
        elif c.get("finish_reason") not in ("stop", "length", *(("abort",) if self.partial else ())):
            bad = (f"ended with finish_reason {c.get('finish_reason')!r} (expected stop or length"
                   f"{', or abort by a sync' if self.partial else ''})")
        elif c.get("finish_reason") == "stop" and params.stop_token_ids and (not ids or ids[-1] not in
                                                                              params.stop_token_ids):
            bad = "says it stopped, and does not end with a stop token"
        if bad:
            raise ServerError(f"vLLM server {server.url}: a completion {bad}")
        return [int(t) for t in ids], [float(lp) for lp in lps], c.get("finish_reason")

    def _check(self, policy, servers: list[Server]) -> None:
        """The sync check: each server's log-probs of 8 sampled tokens of a fixed prompt against the trainer's."""
        params = SamplingParams(group_size=1, max_new_tokens=CHECK_TOKENS, stop_token_ids=(), pad_token_id=0,
                                temperature=self.temperature)
        for s in servers:
            [(ids, lps, _)] = self._complete(s, CHECK_PROMPT, params, seed=0, ignore_eos=True)
            problem = self.check(policy, CHECK_PROMPT, ids, lps)
            self.last_check[s.url] = problem[1] if problem else 0.0
            if problem and problem[0]:
                raise ServerError(f"vLLM server {s.url}: after the sync its log-probs of a fixed prompt differ from "
                                  f"the trainer's by {problem[1]:.3g} on average (bound {problem[2]:g}): it does not "
                                  "sample the policy (another model's config, a failed reload, or a server not "
                                  "started with --logprobs-mode processed_logprobs)")


def _left(deadline: float, s: Server, total: float) -> float:
    """Seconds left before a sync's `deadline` (time.monotonic()), or its ServerError when none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise _sync_overrun(s, total)
    return left


def _sync_call(s: Server, path: str, body: dict | None, deadline: float, total: float, cap: float = math.inf):
    """One call of a sync (a POST with a body, else a GET), within what is left of its deadline and at
    most `cap` seconds; cut by the sync's deadline, it says that one (--vllm-server-sync-timeout)."""
    left = _left(deadline, s, total)
    try:
        return s.call(path, body, timeout=min(cap, left), what=path.split("?")[0])
    except ServerError:
        if left < cap and time.monotonic() >= deadline - 0.05:
            raise _sync_overrun(s, total) from None
        raise


def _sync_overrun(s: Server, total: float) -> ServerError:
    return ServerError(f"vLLM server {s.url}: the weight sync did not finish within {total:g} s "
                       "(--vllm-server-sync-timeout)")


# --- a server gspo starts ----------------------------------------------------------------------


@dataclass(frozen=True)
class Serve:
    """How a server gspo starts is started (OwnedServer)."""

    dtype: str
    seed: int
    max_model_len: int
    kv_cache_gib: float = 2.0  # CPU: VLLM_CPU_KVCACHE_SPACE, unless set
    gpu_memory_utilization: float = 0.3  # CUDA
    weight_transfer: str | None = None  # "nccl": vLLM's weight-transfer engine on (--weight-transfer-config)
    python: str | None = None  # the interpreter with vLLM (None: this one)


class OwnedServer:
    """A `vllm serve` gspo starts for a one-machine run and stops at its end: 127.0.0.1 only, a free
    port, a random API key in its environment, its own process group (stopped whole: the API
    server and vLLM's engine process), and on Linux told to end if this process dies
    (PR_SET_PDEATHSIG). Its output goes to `log`."""

    def __init__(self, model_dir: str, how: Serve, log: Path):
        dtype, seed, max_model_len = how.dtype, how.seed, how.max_model_len
        self.key = secrets.token_urlsafe(32)
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [how.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                     "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype, "--seed", str(seed),
                     "--max-model-len", str(max_model_len), "--logprobs-mode", "processed_logprobs",
                     "--enable-prefix-caching", "--served-model-name", model_dir]
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", **{KEY_VARIABLE: self.key})
        if how.weight_transfer:  # vLLM's weight-transfer engine (NCCL): the trainer joins its group at the first sync
            self.argv += ["--weight-transfer-config", json.dumps({"backend": how.weight_transfer})]
        if torch.cuda.is_available():
            self.argv += ["--gpu-memory-utilization", str(how.gpu_memory_utilization)]
        else:  # vLLM's CPU rules: no chunked prefill (seeded generators), eager, a whole prompt per step
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(how.kv_cache_gib))))
            self.argv += ["--no-enable-chunked-prefill", "--enforce-eager",
                          "--max-num-batched-tokens", str(max(max_model_len, 2048))]
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True, preexec_fn=_die_with_parent)
        self._lock = threading.Lock()
        atexit.register(self.stop)  # this interpreter ending (an error before the run began included)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        server = Server(self.url)
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(f"the vLLM server gspo started exited ({code}) before it answered; its output: "
                                  f"{self.log} ({_last_error(self.log)})")
            try:
                server.call("/health", timeout=5, what="/health")
                return
            except ServerError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise ServerError(f"the vLLM server gspo started did not answer /health within {timeout:g} s "
                                      f"(--vllm-server-start-timeout); its output: {self.log}") from None
                time.sleep(1.0)

    def stop(self, grace: float = 15.0) -> None:
        with self._lock:
            if self.proc.poll() is not None:
                return
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    return
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            try:  # the engine process vLLM started is in the same group: make sure it went too
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _last_error(log: Path) -> str:
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "unreadable"
    errors = [line for line in lines if "Error" in line and "Warning" not in line]
    return " ".join((errors or lines or ["no output"])[-1].split())[:200]


def free_port(address: str) -> int:
    """A port free on `address` now (whoever opens it does so a moment later)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: end when the trainer's process does (Linux), so a killed trainer leaves no server."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass
