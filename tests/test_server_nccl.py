"""NcclPush (gspo.sampling.server_nccl) against recording fakes of vLLM's trainer-side pieces and
the server's routes: no GPU, no vLLM. The calls, their order and arguments, the tensors sent (the
policy's, cast), the group made once, the deadline kept while a broadcast hangs, the errors in one line."""

import sys
import threading
import time
import types
from dataclasses import dataclass

import pytest
import torch

from gspo.config import ConfigError
from gspo.sampling import server_nccl
from gspo.sampling.server_nccl import HttpClient, NcclPush, local_address
from gspo.sampling.vllm_server import Server, ServerError, free_port


@pytest.fixture(scope="module")
def policy():
    from transformers import Qwen3ForCausalLM

    from gspo.models.tiny import tiny_config

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_config(20, tie_word_embeddings=True)).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


@dataclass
class FakeInfo:  # vLLM's NCCLTrainerInitInfo, as NcclPush fills it
    master_address: str
    master_port: int
    world_size: int
    rank: int


class FakeClient:
    def __init__(self, server, total, log, workers):
        self.url, self.total, self.log, self.workers, self.deadline = server.url, total, log, workers, None

    def world_size(self):
        self.log.append((self.url, "world_size"))
        return self.workers

    def init_weight_transfer_engine(self, init_info):
        self.log.append((self.url, "init", init_info))

    def start_weight_update(self):
        self.log.append((self.url, "start"))

    def update_weights(self, update_info):
        self.log.append((self.url, "update", update_info))

    def finish_weight_update(self, weight_version=None):
        self.log.append((self.url, "finish", weight_version))

    def shutdown_weight_transfer_engine(self):
        self.log.append((self.url, "shutdown"))


def fake_api(log, block: threading.Event | None = None, rendezvous_blocks: bool = False):
    class Engine:
        packed_buffer_size_bytes, packed_num_buffers = 123, 2

        def __init__(self, url):
            self.model_update_group = types.SimpleNamespace(url=url, sent=[])

        def shutdown(self):
            log.append((self.model_update_group.url, "destroy"))

    class Factory:
        @staticmethod
        def trainer_init(info, *, client, source):
            url = client.url
            log.append((url, "trainer_init", info))

            def init(payload):  # as vLLM: alongside the rendezvous, its error kept (a future's)
                try:
                    client.init_weight_transfer_engine(payload)
                except ServerError:
                    pass

            payload = {"master_address": info.master_address, "master_port": info.master_port, "rank_offset": 1,
                       "world_size": info.world_size}
            waiter = threading.Thread(target=init, args=(payload,), daemon=True)
            waiter.start()
            if rendezvous_blocks:
                time.sleep(30)  # the TCPStore waits for workers that never come
            waiter.join()
            return Engine(url)

    def producer(*, iterator, group, src, post_iter_func, buffer_size_bytes, num_buffers):
        assert (src, buffer_size_bytes, num_buffers) == (0, 123, 2)
        items = [(name, post_iter_func((name, t)).detach().clone()) for name, t in iterator]
        if block is not None:
            block.wait(30)  # an NCCL broadcast whose peers never come
        group.sent.extend(items)
        log.append((group.url, "broadcast", [n for n, _ in items]))

    return types.SimpleNamespace(NCCLTrainerInitInfo=FakeInfo, WeightTransferTrainerFactory=Factory,
                                 packed_nccl_broadcast_producer=producer, source=object)


def make_push(log, workers=2, **kw):
    api = kw.pop("api", None) or fake_api(log)
    return NcclPush(torch.bfloat16, api=api, client=lambda s, total: FakeClient(s, total, log, workers), **kw)


def servers(*ports):
    out = [Server(f"http://127.0.0.1:{p}") for p in ports]
    for s in out:
        s.weights = "default"  # fresh servers, as the sampler sees them
    return out


def test_protocol_and_weights(policy):
    log = []
    push = make_push(log, workers=2, chunk_bytes=64 << 10)
    a, b = servers(8001, 8002)
    push.push(policy, [a, b], "run:1", 60, time.monotonic() + 60)
    for s in (a, b):
        s.weights = "run:1"
    first = list(log)
    del log[:]
    push.push(policy, [a, b], "run:2", 60, time.monotonic() + 60)

    # the group: once per server, at the first push; 1 trainer (rank 0) + the server's 2 workers
    joins = [e for e in first if e[1] in ("world_size", "trainer_init", "init")]
    assert [e[:2] for e in joins] == [(a.url, "world_size"), (a.url, "trainer_init"), (a.url, "init"),
                                      (b.url, "world_size"), (b.url, "trainer_init"), (b.url, "init")]
    infos = [e[2] for e in joins if e[1] == "trainer_init"]
    assert [(i.world_size, i.rank, i.master_address) for i in infos] == [(3, 0, "127.0.0.1")] * 2
    assert all(1024 <= i.master_port < 65536 for i in infos)
    assert [e[2] for e in joins if e[1] == "init"] == [
        {"master_address": "127.0.0.1", "master_port": i.master_port, "rank_offset": 1, "world_size": 3}
        for i in infos]
    assert not [e for e in log if e[1] in ("world_size", "trainer_init", "init")]  # the second push: no new group

    sd = policy.state_dict()
    expected = list(sd)  # the tied LM head: its own name too, after the embedding's
    assert expected.count("lm_head.weight") == 1 and "model.embed_tokens.weight" in expected
    sizes = [sd[n].numel() * 2 for n in expected]
    chunks, size = 0, 0
    for n in sizes:
        size += n
        if size >= 64 << 10:
            chunks, size = chunks + 1, 0
    chunks += size > 0
    assert chunks > 2
    for events in (first[6:], log):
        steps = [e[:2] for e in events]
        per_chunk = [(a.url, "update"), (a.url, "broadcast"), (b.url, "update"), (b.url, "broadcast")]
        assert steps == [(a.url, "start"), (b.url, "start")] + per_chunk * chunks + \
            [(a.url, "finish"), (b.url, "finish")], steps
        for url in (a.url, b.url):
            updates = [e[2] for e in events if e[:2] == (url, "update")]
            assert sum((u["names"] for u in updates), []) == expected
            assert sum((u["shapes"] for u in updates), []) == [list(sd[n].shape) for n in expected]
            assert {d for u in updates for d in u["dtype_names"]} == {"bfloat16"}
            assert [e[2] for e in events if e[:2] == (url, "finish")] == [None]  # the caller tags the version
    for s in (a, b):
        sent = push.engines[s.url].model_update_group.sent
        assert [n for n, _ in sent] == expected * 2  # both pushes
        for name, value in sent:
            assert value.dtype == torch.bfloat16
            assert torch.equal(value, sd[name].to(torch.bfloat16)), name
    got = dict(push.engines[a.url].model_update_group.sent)
    assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])

    push.close()
    assert [e[:2] for e in log[-4:]] == [(a.url, "shutdown"), (a.url, "destroy"), (b.url, "shutdown"),
                                         (b.url, "destroy")]


def test_restarted_server_rejoins(policy):
    log = []
    push = make_push(log, workers=4)
    [s] = servers(8003)
    push.push(policy, [s], "run:1", 60, time.monotonic() + 60)
    s.weights = "run:1"
    push.push(policy, [s], "run:2", 60, time.monotonic() + 60)
    s.weights = "default"  # it restarted: its group is gone
    push.push(policy, [s], "run:3", 60, time.monotonic() + 60)
    inits = [e[2] for e in log if e[1] == "trainer_init"]
    assert [i.world_size for i in inits] == [5, 5]


def test_a_hung_broadcast_is_an_error_at_the_deadline(policy):
    log, block = [], threading.Event()
    push = make_push(log, api=fake_api(log, block=block))
    [s] = servers(8004)
    t0 = time.monotonic()
    try:
        with pytest.raises(ServerError) as err:
            push.push(policy, [s], "run:1", 0.5, t0 + 0.5)
        took = time.monotonic() - t0
        message = str(err.value)
        assert 0.5 <= took < 1.5, took
        assert "\n" not in message and s.url in message
        assert "did not finish within 0.5 s (--vllm-server-sync-timeout)" in message
        assert "must exit" in message
        t1 = time.monotonic()
        with pytest.raises(ServerError, match="did not finish"):  # refused at once: the thread is still in "NCCL"
            push.push(policy, [s], "run:2", 0.5, time.monotonic() + 0.5)
        assert time.monotonic() - t1 < 0.2
        push.close()
        assert not [e for e in log if e[1] in ("shutdown", "destroy")]  # nothing touches a stuck group
    finally:
        block.set()


class NotConfiguredServer(Server):
    """Answers as vLLM 0.32 does without --weight-transfer-config (the worker's RuntimeError, a 500)."""

    def call(self, path, body=None, *, timeout, what=None, method=None):
        self.seen = getattr(self, "seen", []) + [(path, body, timeout)]
        if path == "/get_world_size":
            return {"world_size": 1}
        raise ServerError(f"vLLM server {self.url}: {path} answered 500 ({{\"error\": {{\"message\": \"Weight "
                          "transfer not configured. Please set weight_transfer_config to enable weight transfer.\", "
                          "\"type\": \"InternalServerError\", \"code\": 500}})")


def test_a_server_without_weight_transfer_is_named(policy):
    log = []
    push = NcclPush(torch.bfloat16, api=fake_api(log, rendezvous_blocks=True))  # the real HttpClient
    s = NotConfiguredServer("http://127.0.0.1:8005")
    t0 = time.monotonic()
    with pytest.raises(ServerError) as err:
        push.push(policy, [s], "run:1", 60, t0 + 60)
    assert time.monotonic() - t0 < 3  # not at the deadline: the rendezvous waits on, abandoned
    message = str(err.value)
    assert "\n" not in message and s.url in message and "weight transfer is not configured" in message
    assert "--weight-transfer-config '{\"backend\":\"nccl\"}'" in message
    (path0, _, t_world), (path1, body, t_init) = s.seen
    assert (path0, path1) == ("/get_world_size", "/init_weight_transfer_engine")
    assert body["init_info"]["world_size"] == 2 and body["init_info"]["rank_offset"] == 1
    assert 55 < t_init <= t_world <= 60  # the time left, not a fixed timeout


def test_http_client_calls_within_the_time_left():
    class Recording(Server):
        def call(self, path, body=None, *, timeout, what=None, method=None):
            self.seen.append((path, body, round(timeout)))

    s = Recording("http://127.0.0.1:8006")
    s.seen = []
    client = HttpClient(s, 100)
    client.deadline = time.monotonic() + 40
    client.start_weight_update()
    client.update_weights({"names": ["w"]})
    client.finish_weight_update()
    assert s.seen == [("/start_weight_update", {}, 40), ("/update_weights", {"update_info": {"names": ["w"]}}, 40),
                      ("/finish_weight_update", {}, 40)]
    client.deadline = time.monotonic() - 1
    with pytest.raises(ServerError, match="did not finish within 100 s"):
        client.finish_weight_update()
    assert len(s.seen) == 3  # nothing sent after the deadline


def test_missing_vllm_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm...` raises ImportError
    with pytest.raises(ConfigError) as err:
        NcclPush(torch.bfloat16)
    message = str(err.value)
    assert "\n" not in message
    assert "pip install 'gspo[vllm]' in the trainer's environment" in message
    assert server_nccl.INSTALL in message


def test_addresses():
    assert local_address("http://127.0.0.1:8000") == "127.0.0.1"
    port = free_port("127.0.0.1")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free indeed
