"""Weights to vLLM servers over NCCL: vLLM's own weight-transfer engine, the trainer's side.

    push = NcclPush(torch.bfloat16, Deadlines(sync=300))   # --vllm-server-sync nccl (auto: on CUDA)
    push.push(policy, servers, tag, timeout, deadline)     # by ServerSampler.sync: servers paused, tagged after
    push.close()                                            # each server's group released

The `push` of gspo.sampling.vllm_server for GPU servers, on this machine or another node: the
policy's weights go straight from the trainer's GPU to every server worker's GPU, nothing on disk.
The server must be started with `--weight-transfer-config '{"backend":"nccl"}'` (a server gspo
starts is) and VLLM_SERVER_DEV_MODE=1 (its RL routes). Step by step, with vLLM 0.32's pieces
(vllm/distributed/weight_transfer: nccl_engine, packed_tensor; the routes of
vllm/entrypoints/rl/online/api_router.py):

1. **The group, once per server, at the first push.** `GET /get_world_size` (the server's workers,
   TP x PP x DP); the NCCL group is 1 trainer (rank 0, the sender) + those workers. The
   rendezvous is a TCPStore this process opens: the address the server reaches us at
   (`master_address`, else the local IP a packet to the server's URL leaves from) and a free
   port. `WeightTransferTrainerFactory.trainer_init(NCCLTrainerInitInfo(rank=0, ...))` posts
   `/init_weight_transfer_engine` (the workers join at rank_offset 1) while it opens rank 0;
   packed transfer, vLLM's buffer sizes. A server that restarted (vLLM's "default" weight tag)
   gets a new group. A server without the weight-transfer flag is a ServerError naming it.
2. **Each push, one pass over `checkpoint_weights(policy, dtype)`** (a fresh generator: FSDP
   gathered, LoRA merged, MoE unfused, the tied LM head under both names; under torchrun every
   rank iterates it once, in step): `/start_weight_update` on every server (vLLM's layerwise
   reload), then per chunk of ~CHUNK_BYTES of tensors and per server: `/update_weights` with the
   chunk's names, dtypes and shapes, run alongside the chunk's packed NCCL broadcast (vLLM's
   `packed_nccl_broadcast_producer`; both sides meet inside the same NCCL calls); then
   `/finish_weight_update`. The caller then resets the prefix cache, tags the version, resumes.
   Chunks, not vLLM's `send_weights`: that one declares every tensor's shape before sending
   (`WeightSource.metadata`), which `checkpoint_weights` knows only by making each tensor (a
   gather under FSDP), and it may be made once per push. vLLM's worker takes any number of
   `/update_weights` between start and finish.
3. **Deadlines.** Every HTTP call gets the time left before the sync's deadline. An NCCL call
   cannot be interrupted: the whole push runs in a daemon thread, joined until the deadline; a
   push still running then, or a server call that failed while the broadcast waits for it, is a
   ServerError (the CLI: exit 2, `gspo train --resume`). The stuck thread is abandoned, still
   inside NCCL: this NcclPush refuses further pushes and the process must exit.

Security: the rendezvous port and the NCCL group take any peer that reaches them, as vLLM's do;
run on a network you trust (docs/server.md).

What awaits a GPU: nothing here has run NCCL. The tests drive the protocol with recording fakes
of vLLM's factory, broadcast and the HTTP client (the calls, their order and arguments, the
bytes sent, the deadline); the rendezvous, the broadcast and a real server's answers are
vLLM's code as read, not as run.
"""

from __future__ import annotations

import socket
import threading
import time
import types
import urllib.parse

import torch

from gspo.config import ConfigError
from gspo.config.checks import one_line
from gspo.sampling.vllm_engine import checkpoint_weights
from gspo.sampling.vllm_server import Deadlines, Server, ServerError, _reason, free_port

CHUNK_BYTES = 1 << 30  # the tensors sent per /update_weights (~1 GiB, vLLM's packed buffer size)
INSTALL = ("pip install 'gspo[vllm]' in the trainer's environment: the NCCL sync uses vLLM's trainer-side engine")
NOT_CONFIGURED = ("start it with --weight-transfer-config '{\"backend\":\"nccl\"}' (and VLLM_SERVER_DEV_MODE=1), "
                  "or use --vllm-server-sync directory")


def vllm_api():
    """vLLM's trainer-side pieces NcclPush drives (a namespace; the tests pass fakes of it)."""
    try:
        from vllm.distributed.weight_transfer import WeightSource, WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer
    except ImportError as e:
        raise ConfigError(f"vllm_server_sync: nccl needs vLLM in this process ({_reason(e)}); {INSTALL}") from None

    class Unused(WeightSource):
        """vLLM's NCCL trainer_init wants a source; NcclPush sends in chunks and never asks it."""

        def metadata(self):
            raise RuntimeError("gspo's NcclPush sends in chunks; the engine's send_weights is not used")

        def __iter__(self):
            raise RuntimeError("gspo's NcclPush sends in chunks; the engine's send_weights is not used")

    return types.SimpleNamespace(NCCLTrainerInitInfo=NCCLTrainerInitInfo,
                                 WeightTransferTrainerFactory=WeightTransferTrainerFactory,
                                 packed_nccl_broadcast_producer=packed_nccl_broadcast_producer, source=Unused)


class HttpClient:
    """vLLM's weight-sync control plane for one server (the four methods of vLLM's
    VLLMWeightSyncClient protocol, and its world size) over gspo's Server.call: the server's key,
    one-line ServerErrors, and each call within the time left before `deadline` (set per push).
    vLLM's HTTPVLLMWeightSyncClient does the same with one fixed timeout per call and no key."""

    def __init__(self, server: Server, total: float):
        self.server, self.total = server, total
        self.deadline = time.monotonic() + total

    def _left(self, what: str) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ServerError(f"vLLM server {self.server.url}: the weight sync (NCCL) did not finish within "
                              f"{self.total:g} s (--vllm-server-sync-timeout); {what} was not sent")
        return left

    def _post(self, route: str, body: dict):
        return self.server.call(route, body, timeout=self._left(route), what=route)

    def world_size(self) -> int:
        answer = self.server.call("/get_world_size", timeout=self._left("/get_world_size"), what="/get_world_size")
        size = (answer or {}).get("world_size") if isinstance(answer, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ServerError(f"vLLM server {self.server.url}: /get_world_size answered {answer!r}, not a world size")
        return size

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        try:
            self._post("/init_weight_transfer_engine", {"init_info": init_info})
        except ServerError as e:
            text = str(e).lower()
            if "not configured" in text or "weight_transfer_config" in text:
                raise ServerError(f"vLLM server {self.server.url}: weight transfer is not configured; "
                                  f"{NOT_CONFIGURED}") from None
            raise

    def start_weight_update(self) -> None:
        self._post("/start_weight_update", {})

    def update_weights(self, update_info) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("/finish_weight_update", {} if weight_version is None else {"weight_version": weight_version})

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("/shutdown_weight_transfer_engine", {})


class _Watched:
    """A client whose failures the push hears of at once (vLLM's trainer_init reads its init call's
    error only after the rendezvous, which waits for workers that will not come)."""

    def __init__(self, client, push: NcclPush, url: str):
        self.client, self.push, self.url = client, push, url

    def __getattr__(self, name):
        method = getattr(self.client, name)

        def call(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except BaseException as e:
                self.push._fail(self.url, e)
                raise

        return call


class NcclPush:
    """The `push` of gspo.sampling.vllm_server over vLLM's NCCL weight-transfer engine (see the
    module docstring). `master_address`: the address the servers reach this process at (None:
    the local IP that routes to each server). `api` and `client`: vLLM's pieces and the control
    plane client (None: vLLM's, imported now, and HttpClient), to be replaced in tests.

    A push that passes its deadline inside NCCL leaves its thread there, abandoned (NCCL cannot
    be interrupted): the push raises ServerError, this object refuses every later push, and the
    process must exit (the CLI does: exit 2)."""

    name = "nccl"

    def __init__(self, dtype: torch.dtype, deadlines: Deadlines | None = None, *, master_address: str | None = None,
                 chunk_bytes: int = CHUNK_BYTES, api=None, client=None):
        self.dtype, self.deadlines = dtype, deadlines or Deadlines()
        self.master_address, self.chunk_bytes = master_address, int(chunk_bytes)
        self.api = api if api is not None else vllm_api()
        self.client_factory = client or HttpClient
        self.engines: dict[str, object] = {}  # server URL -> vLLM's trainer engine (its NCCL group)
        self.clients: dict[str, object] = {}
        self.broken: str | None = None  # why pushes are refused (a thread abandoned inside NCCL)
        self._state: dict = {}

    # --- the push interface ---

    def push(self, policy, servers: list[Server], tag: str, timeout: float, deadline: float) -> None:
        if self.broken:
            raise ServerError(self.broken)
        self._state = {"failure": None, "server": None, "doing": "starting", "done": False}
        for s in servers:
            if s.url in self.engines and s.weights in (None, "None", "default"):  # restarted: its group is gone
                self.engines.pop(s.url)  # not destroyed: its peers are gone, a destroy could wait on them
            client = self.clients.get(s.url)
            if client is None:
                client = self.clients[s.url] = self.client_factory(s, timeout)
            client.deadline = deadline
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        error: list[BaseException] = []

        def run():
            try:
                if device is not None:
                    torch.cuda.set_device(device)  # a thread starts on device 0
                self._send(policy, servers, device)
            except BaseException as e:
                error.append(e)
            finally:
                self._state["done"] = True

        worker = threading.Thread(target=run, name="gspo-nccl-push", daemon=True)
        worker.start()
        while worker.is_alive() and self._state["failure"] is None:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            worker.join(min(left, 0.05))
        if worker.is_alive() and self._state["failure"] is not None:  # a call failed: the thread may end by itself
            worker.join(max(0.0, min(1.0, deadline - time.monotonic())))
        if worker.is_alive():  # past the deadline, or a server call failed while the broadcast waits for it
            failure = self._state["failure"]
            where = self._state["server"] or (servers[0].url if servers else "?")
            self.broken = (f"vLLM server {where}: the weight sync (NCCL) did not finish within {timeout:g} s "
                           f"(--vllm-server-sync-timeout); it was at {self._state['doing']}. NCCL cannot be "
                           "interrupted: its thread is abandoned and this process must exit (gspo train --resume "
                           "RUN continues; restart the server if it stays stuck)")
            if failure is not None:
                self.broken = (f"{_one_line(failure)}; the weight sync (NCCL) is left waiting on it: this process "
                               "must exit (gspo train --resume RUN continues)")
            raise ServerError(self.broken)
        if error:
            e = error[0]
            if isinstance(e, ServerError):
                raise ServerError(_one_line(e)) from None
            where = self._state["server"] or "?"
            raise ServerError(f"vLLM server {where}: the weight sync (NCCL) failed at {self._state['doing']} "
                              f"({type(e).__name__}: {_reason(e)})") from None

    def close(self) -> None:
        """Each server's group released (its route, then the trainer's communicator), within the
        request deadline; nothing when a push was abandoned inside NCCL."""
        engines, self.engines = self.engines, {}
        if self.broken or not engines:
            return

        def release():
            for url, engine in engines.items():
                client = self.clients.get(url)
                try:
                    if client is not None:
                        client.deadline = time.monotonic() + min(self.deadlines.request, 30.0)
                        client.shutdown_weight_transfer_engine()
                except Exception:
                    pass
                try:
                    engine.shutdown()
                except Exception:
                    pass

        closer = threading.Thread(target=release, name="gspo-nccl-close", daemon=True)
        closer.start()
        closer.join(min(self.deadlines.request, 30.0) * (len(engines) + 1))

    # --- the pieces ---

    def _fail(self, url: str, e: BaseException) -> None:
        if self._state.get("failure") is None and not self._state.get("done"):
            self._state["failure"], self._state["server"] = e, url

    def _at(self, s: Server, doing: str) -> None:
        self._state["server"], self._state["doing"] = s.url, f"{s.url}: {doing}"

    def _send(self, policy, servers: list[Server], device) -> None:
        for s in servers:
            if s.url not in self.engines:
                self._at(s, "joining its NCCL group")
                self.engines[s.url] = self._join(s)
        for s in servers:
            self._at(s, "/start_weight_update")
            _Watched(self.clients[s.url], self, s.url).start_weight_update()
        chunk, size = [], 0
        for name, tensor in checkpoint_weights(policy, self.dtype):
            if device is not None and not tensor.is_cuda:
                tensor = tensor.to(device)
            chunk.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= self.chunk_bytes:
                self._send_chunk(servers, chunk)
                chunk, size = [], 0
        if chunk:
            self._send_chunk(servers, chunk)
        if device is not None:
            torch.cuda.current_stream().synchronize()
        for s in servers:
            self._at(s, "/finish_weight_update")
            _Watched(self.clients[s.url], self, s.url).finish_weight_update()

    def _join(self, s: Server):
        client = _Watched(self.clients[s.url], self, s.url)
        workers = client.world_size()
        address = self.master_address or local_address(s.url)
        info = self.api.NCCLTrainerInitInfo(master_address=address, master_port=free_port(address),
                                            world_size=1 + workers, rank=0)
        self._at(s, f"the NCCL rendezvous at {address}:{info.master_port} (world size {1 + workers})")
        return self.api.WeightTransferTrainerFactory.trainer_init(info, client=client, source=self.api.source())

    def _send_chunk(self, servers: list[Server], chunk: list) -> None:
        update_info = {"names": [n for n, _ in chunk], "dtype_names": [str(t.dtype).split(".")[-1] for _, t in chunk],
                       "shapes": [list(t.shape) for _, t in chunk]}
        for s in servers:
            engine = self.engines[s.url]
            self._at(s, f"/update_weights ({len(chunk)} tensors from {chunk[0][0]})")
            client = _Watched(self.clients[s.url], self, s.url)
            error: list[BaseException] = []

            def update(client=client, error=error):
                try:
                    client.update_weights(update_info)
                except BaseException as e:
                    error.append(e)

            receiver = threading.Thread(target=update, name="gspo-nccl-update", daemon=True)  # the workers receive
            receiver.start()  # alongside the broadcast: both meet inside the same NCCL calls
            self.api.packed_nccl_broadcast_producer(
                iterator=iter(chunk), group=engine.model_update_group, src=0, post_iter_func=lambda item: item[1],
                buffer_size_bytes=engine.packed_buffer_size_bytes, num_buffers=engine.packed_num_buffers)
            receiver.join()  # its HTTP call is bounded by the time left
            if error:
                raise error[0]


def local_address(url: str) -> str:
    """The local IP a packet to the server's URL leaves from (a UDP socket's connect sends nothing)."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "", parts.port or 80
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(addr)
            return probe.getsockname()[0]
    except OSError as e:
        raise ServerError(f"vLLM server {url}: no local address routes to it ({_reason(e)}); give the address it "
                          "reaches this machine at") from None


def _one_line(e: BaseException) -> str:
    return one_line(e) or type(e).__name__
