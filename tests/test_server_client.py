"""gspo.sampling.vllm_server's client against a fake vLLM server (tests/fakevllm.py): URLs, keys,
deadlines, connect, the weight sync's order and skips, sampling, verify and the sync check.

No vLLM and no training: the policy is a small torch module; every test takes well under 2 s."""

import http.client
import socket
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from gspo.sampling import vllm_server as vs
from gspo.sampling.rollout import SamplingParams
from gspo.sampling.vllm_server import (
    CHECK_PROMPT,
    CHECK_TOKENS,
    Deadlines,
    DirectoryPush,
    Server,
    ServerError,
    ServerSampler,
    connect,
    probe,
    same_model,
    servers_from,
)
from tests.fakevllm import FakeVLLM

MARGIN = 0.35  # seconds past a deadline a call may take to give up (thread wake-ups on a loaded 2-core machine)
FAST = Deadlines(request=2.0, sync=10.0, start=2.0)
PROBE_ROUTES = ["/health", "/version", "/v1/models", "/weight_info", "/server_info"]
# the pending tag before the reload, read back after it (a sync by someone else meanwhile is seen), the final tag
SYNC_ROUTES = ["/weight_info", "/pause?mode=wait", "/update_weight_version", "/collective_rpc", "/weight_info",
               "/reset_prefix_cache", "/update_weight_version", "/resume"]


@pytest.fixture(autouse=True)
def no_weight_conversions(monkeypatch):
    """checkpoint_weights asks transformers for a model's weight conversions (fused MoE experts): the
    question imports transformers.modeling_utils (~3 s here) and a plain torch module has none."""
    from gspo.sampling import vllm_engine

    monkeypatch.setattr(vllm_engine, "_reverter", lambda model: None)


@pytest.fixture
def fake():
    with FakeVLLM() as f:
        yield f


@pytest.fixture
def fakes():
    with FakeVLLM() as a, FakeVLLM() as b:
        yield a, b


class Policy(nn.Module):
    """A tiny LM-shaped module: an embedding, a layer, and a head tied to the embedding."""

    def __init__(self, vocab=50, hidden=4):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, hidden)
        self.layer = nn.Linear(hidden, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.embed.weight


def sampler_for(servers, root, **kw):
    for s in servers:
        probe(s, 2.0)
    return ServerSampler(servers, DirectoryPush(root, torch.float32), kw.pop("deadlines", FAST), run_id="run", **kw)


def routes_from(fake, start=0):
    return fake.routes()[start:]


# --- URLs and keys -----------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["localhost:8000", "127.0.0.1:8000", "http://127.0.0.1:8000/v1",
                                 "http://127.0.0.1:8000/?x=1", "ftp://127.0.0.1:8000", "http://:8000",
                                 "http://127.0.0.1:port", "http://127.0.0.1:99999"])
def test_a_malformed_url_is_refused_naming_it(url):
    with pytest.raises(ServerError, match="vllm_server_url") as e:
        Server(url)
    assert repr(url) in str(e.value)


def test_a_well_formed_url_is_kept_without_its_slash():
    assert Server("http://127.0.0.1:8000/").url == "http://127.0.0.1:8000"
    assert Server("https://h.example:443").url == "https://h.example:443"


def test_a_url_given_twice_is_refused():
    with pytest.raises(ServerError, match=r"http://127\.0\.0\.1:8000 is given twice"):
        servers_from(["http://127.0.0.1:8000", "http://127.0.0.1:8001", "http://127.0.0.1:8000/"])


def test_the_key_comes_from_vllm_api_key(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    with FakeVLLM(key="secret") as fake:
        [s] = servers_from([fake.url])
        assert s.key == "secret"
        probe(s, 2.0)
        assert s.model == "tiny-model" and s.max_model_len == 64 and s.version == "0.32.0"
        assert s.weights == "default" and s.device == "cpu"
        assert fake.asked("/v1/models")[0].headers["Authorization"] == "Bearer secret"
        # an explicit key (a server gspo started) wins over the variable
        assert servers_from([fake.url], key="mine")[0].key == "mine"


def test_a_wrong_key_is_one_line_naming_vllm_api_key(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "wrong")
    with FakeVLLM(key="secret") as fake:
        [s] = servers_from([fake.url])
        with pytest.raises(ServerError) as e:
            probe(s, 2.0)
        text = str(e.value)
        assert "\n" not in text and fake.url in text and "401" in text and "VLLM_API_KEY" in text


def test_no_key_at_all_is_refused_too(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with FakeVLLM(key="secret") as fake:
        [s] = servers_from([fake.url])
        assert s.key is None
        with pytest.raises(ServerError, match="VLLM_API_KEY"):
            probe(s, 2.0)


def test_no_dev_routes_says_vllm_server_dev_mode(fake):
    fake.status["/weight_info"] = 404
    with pytest.raises(ServerError) as e:
        probe(Server(fake.url), 2.0)
    assert "VLLM_SERVER_DEV_MODE=1" in str(e.value) and "/weight_info" in str(e.value) and fake.url in str(e.value)


def test_a_404_on_a_v1_route_is_not_blamed_on_dev_mode(fake):
    fake.status["/v1/models"] = 404
    with pytest.raises(ServerError) as e:
        probe(Server(fake.url), 2.0)
    assert "answered 404" in str(e.value) and "DEV_MODE" not in str(e.value)


def test_an_error_status_not_json_and_a_dropped_connection_are_server_errors(fake):
    s = Server(fake.url)
    fake.status["/version"] = 500
    with pytest.raises(ServerError, match=r"/version answered 500 \(.*fake status 500"):
        s.call("/version", timeout=2.0)
    del fake.status["/version"]
    fake.not_json.add("/version")
    with pytest.raises(ServerError, match="not JSON"):
        s.call("/version", timeout=2.0)
    fake.not_json.clear()
    fake.drop.add("/version")
    with pytest.raises(ServerError, match=r"/version failed"):
        s.call("/version", timeout=2.0)
    fake.drop.clear()
    assert s.call("/version", timeout=2.0) == {"version": "0.32.0"}


def test_an_empty_model_list_is_refused(fake, monkeypatch):
    monkeypatch.setattr(fake, "_answer", lambda m, r, b: (200, {"data": []}) if r == "/v1/models"
                        else FakeVLLM._answer(fake, m, r, b))
    with pytest.raises(ServerError, match="lists no model"):
        probe(Server(fake.url), 2.0)


# --- deadlines ---------------------------------------------------------------------------------


def test_a_slow_route_is_cut_at_the_deadline(fake):
    fake.delay["/health"] = 5.0
    t0 = time.monotonic()
    with pytest.raises(ServerError) as e:
        probe(Server(fake.url), 0.5)
    took = time.monotonic() - t0
    assert took < 0.5 + MARGIN, took
    assert fake.url in str(e.value) and "0.5 s" in str(e.value) and "/health" in str(e.value)


def test_a_slow_completion_is_cut_at_the_request_deadline(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path, deadlines=Deadlines(request=0.5, sync=10.0))
    sampler.sync(Policy(), version=0)
    fake.delay["/v1/completions"] = 5.0
    params = SamplingParams(group_size=2, max_new_tokens=4, stop_token_ids=(), pad_token_id=0)
    t0 = time.monotonic()
    with pytest.raises(ServerError) as e:
        sampler.sample([[1, 2]], params, generator=torch.Generator().manual_seed(0))
    took = time.monotonic() - t0
    sampler.close()
    assert took < 0.5 + MARGIN, took
    assert fake.url in str(e.value) and "0.5 s" in str(e.value) and "completion request" in str(e.value)


def test_a_slow_sync_is_cut_at_the_sync_deadline(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path, deadlines=Deadlines(request=2.0, sync=0.5))
    fake.delay["/collective_rpc"] = 5.0
    t0 = time.monotonic()
    with pytest.raises(ServerError) as e:
        sampler.sync(Policy(), version=0)
    took = time.monotonic() - t0
    assert took < 0.5 + MARGIN + 0.3, took  # + the safetensors write and the /resume after
    assert fake.url in str(e.value) and "reload_weights" in str(e.value)
    assert fake.routes()[-1] == "/resume"


def test_the_sync_deadline_holds_while_a_restarted_server_is_probed(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path, deadlines=Deadlines(request=0.45, sync=0.5))
    for route in ("/health", "/version", "/v1/models", "/server_info"):
        fake.delay[route] = 0.3  # each within the request deadline; together past the sync deadline
    t0 = time.monotonic()
    with pytest.raises(ServerError) as e:
        sampler.sync(Policy(), version=0)  # a fresh server ("default"): probed first
    took = time.monotonic() - t0
    assert "0.5 s" in str(e.value)
    assert took < 0.5 + MARGIN, took


def test_a_server_trickling_its_answer_is_cut_at_the_deadline(fake):
    fake.trickle["/health"] = (0.05, 1.5)  # one byte per 0.05 s; the fake stops after 1.5 s so the test ends
    t0 = time.monotonic()
    with pytest.raises(ServerError) as e:
        Server(fake.url).call("/health", timeout=0.5)
    took = time.monotonic() - t0
    assert "0.5 s" in str(e.value)
    assert took < 0.5 + MARGIN, took


def test_a_closed_port_fails_fast():
    port = vs.free_port("127.0.0.1")
    t0 = time.monotonic()
    with pytest.raises(ServerError) as e:
        probe(Server(f"http://127.0.0.1:{port}"), 5.0)
    assert time.monotonic() - t0 < 1.0
    assert f"http://127.0.0.1:{port}" in str(e.value) and "/health failed" in str(e.value)


def test_free_port_is_bindable():
    port = vs.free_port("127.0.0.1")
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# --- connect -----------------------------------------------------------------------------------


def test_connect_fills_in_the_servers(fakes):
    servers = [Server(f.url) for f in fakes]
    connect(servers, model="tiny-model", needed_len=64, deadlines=FAST)
    facts = [(s.model, s.max_model_len, s.weights, s.device) for s in servers]
    assert facts == [("tiny-model", 64, "default", "cpu")] * 2


def test_connect_refuses_another_model_in_one_line(fake):
    fake.model = "other-model"
    with pytest.raises(ServerError) as e:
        connect([Server(fake.url)], model="tiny-model", needed_len=10, deadlines=FAST)
    text = str(e.value)
    assert "\n" not in text and "'other-model'" in text and "'tiny-model'" in text and fake.url in text


def test_connect_takes_the_models_directory(fake, tmp_path):
    fake.model = str(tmp_path / "models" / "served")
    (tmp_path / "models" / "served").mkdir(parents=True)
    connect([Server(fake.url)], model="org/hub-id", served_dir=fake.model, needed_len=10, deadlines=FAST)
    with pytest.raises(ServerError):
        connect([Server(fake.url)], model="org/hub-id", served_dir=str(tmp_path / "elsewhere"), needed_len=10,
                deadlines=FAST)


def test_connect_refuses_a_server_too_short(fake):
    fake.max_model_len = 32
    with pytest.raises(ServerError) as e:
        connect([Server(fake.url)], model="tiny-model", needed_len=48, deadlines=FAST)
    assert "max_model_len 32" in str(e.value) and "48" in str(e.value) and "--max-model-len 48" in str(e.value)
    connect([Server(fake.url)], model="tiny-model", needed_len=32, deadlines=FAST)  # exactly enough


def test_same_model(tmp_path):
    real = tmp_path / "store" / "qwen"
    real.mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(real)
    assert same_model("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B")
    assert same_model("Qwen/Qwen3-0.6B/", "Qwen/Qwen3-0.6B")
    assert same_model(str(link), str(real))  # one directory through a symlink, whose names differ
    assert same_model("/elsewhere/Qwen3-0.6B", "Qwen/Qwen3-0.6B")  # the same directory name
    assert not same_model("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B")
    assert not same_model(str(link), str(tmp_path / "store"))


# --- the weight sync ---------------------------------------------------------------------------


def test_sync_order_and_the_weights_written(fake, tmp_path):
    policy = Policy()
    sampler = sampler_for([Server(fake.url)], tmp_path)
    start = len(fake.requests)
    sampler.sync(policy, version=0)
    # a fresh server ("default") is probed before it is pushed to
    assert routes_from(fake, start) == [SYNC_ROUTES[0], *PROBE_ROUTES, *SYNC_ROUTES[1:]]
    assert fake.weight_version == "run:1" and not fake.paused
    assert [r.body for r in fake.asked("/update_weight_version")] == [{"new_version": "run:1.pending"},
                                                                     {"new_version": "run:1"}]
    [rpc] = fake.asked("/collective_rpc")
    assert rpc.body["method"] == "reload_weights"
    where = Path(rpc.body["kwargs"]["weights_path"])
    assert where.is_absolute() and where.parent == tmp_path
    written = {}
    for f in sorted(where.glob("*.safetensors")):
        written.update(load_file(str(f)))
    state = policy.state_dict()
    assert set(written) == {"embed.weight", "layer.weight", "layer.bias", "lm_head.weight"} == set(state)
    for name, value in state.items():
        assert torch.equal(written[name], value), name
    assert torch.equal(written["lm_head.weight"], written["embed.weight"])  # the tied head under both names
    assert sampler.pushes == 1 and sampler.pushed_version == 0 and sampler.tag == "run:1"
    sampler.close()
    assert not where.exists()


def test_sync_skips_a_version_held_and_pushes_a_new_one(fake, tmp_path):
    policy = Policy()
    sampler = sampler_for([Server(fake.url)], tmp_path)
    sampler.sync(policy, version=0)
    first = Path(fake.reloads[-1])
    start = len(fake.requests)
    sampler.sync(policy, version=0)
    assert routes_from(fake, start) == ["/weight_info"]  # asked, nothing pushed
    assert sampler.pushes == 1
    with torch.no_grad():
        policy.layer.weight.add_(1.0)
    start = len(fake.requests)
    sampler.sync(policy, version=1)
    assert routes_from(fake, start) == SYNC_ROUTES
    assert fake.weight_version == "run:2" and sampler.pushes == 2
    second = Path(fake.reloads[-1])
    assert second != first and second.exists() and not first.exists()  # the previous version's directory is gone
    written = load_file(str(next(second.glob("*.safetensors"))))
    assert torch.equal(written["layer.weight"], policy.layer.weight)
    sampler.close()


def test_sync_without_a_version_always_pushes(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path)
    sampler.sync(Policy())
    sampler.sync(Policy())
    assert len(fake.reloads) == 2 and fake.weight_version == "run:2"
    sampler.close()


def test_a_restarted_server_is_probed_and_pushed_at_the_same_version(fakes, tmp_path):
    a, b = fakes
    policy = Policy()
    sampler = sampler_for([Server(a.url), Server(b.url)], tmp_path)
    sampler.sync(policy, version=3)
    b.weight_version = "default"  # b restarted
    starts = len(a.requests), len(b.requests)
    sampler.sync(policy, version=3)
    assert routes_from(a, starts[0]) == ["/weight_info"]  # a holds them
    assert routes_from(b, starts[1]) == [SYNC_ROUTES[0], *PROBE_ROUTES, *SYNC_ROUTES[1:]]
    assert b.weight_version == "run:1" == a.weight_version and len(b.reloads) == 2
    assert Path(b.reloads[-1]).exists()  # the same tag's directory, rewritten, not removed
    sampler.close()


def test_a_server_another_run_synced_is_pushed(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path)
    sampler.sync(Policy(), version=0)
    fake.weight_version = "other-run:7"
    start = len(fake.requests)
    sampler.sync(Policy(), version=0)
    assert routes_from(fake, start) == SYNC_ROUTES and fake.weight_version == "run:1"
    sampler.close()


def test_resume_follows_a_failed_push(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path)
    fake.status["/collective_rpc"] = 500
    start = len(fake.requests)
    with pytest.raises(ServerError, match=r"reload_weights\) answered 500"):
        sampler.sync(Policy(), version=0)
    assert routes_from(fake, start) == ["/weight_info", *PROBE_ROUTES, "/pause?mode=wait", "/update_weight_version",
                                        "/collective_rpc", "/resume"]
    assert not fake.paused and sampler.pushed_version is None and sampler.pushes == 0
    del fake.status["/collective_rpc"]
    sampler.sync(Policy(), version=0)  # the next sync pushes
    assert fake.weight_version == "run:1"
    sampler.close()


def test_resume_follows_a_failed_version_tag(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path)
    fake.status["/update_weight_version"] = 500
    with pytest.raises(ServerError):
        sampler.sync(Policy(), version=0)
    assert fake.routes()[-1] == "/resume" and not fake.paused


def test_a_failed_pause_leaves_no_server_paused(fakes, tmp_path):
    a, b = fakes
    sampler = sampler_for([Server(a.url), Server(b.url)], tmp_path)
    b.status["/pause"] = 500
    with pytest.raises(ServerError):
        sampler.sync(Policy(), version=0)
    assert a.asked("/pause") and not a.paused
    assert a.routes()[-1] == "/resume"


def test_a_push_to_two_servers_reaches_both(fakes, tmp_path):
    a, b = fakes
    sampler = sampler_for([Server(a.url), Server(b.url)], tmp_path)
    sampler.sync(Policy(), version=0)
    assert a.reloads == b.reloads and len(a.reloads) == 1
    assert a.weight_version == b.weight_version == "run:1" and not a.paused and not b.paused
    sampler.close()


# --- sampling ----------------------------------------------------------------------------------


PARAMS = SamplingParams(group_size=3, max_new_tokens=5, stop_token_ids=(0, 10, 20, 30, 40), pad_token_id=0)
PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]


def expected_rows(fake, prompts, seeds, params):
    rows = []
    for p, seed in zip(prompts, seeds):
        for i in range(params.group_size):
            rows.append(fake.completion(p, seed, i, params.max_new_tokens, params.stop_token_ids))
    return rows


def test_sample_one_seed_per_prompt_spread_over_two_servers(fakes, tmp_path):
    a, b = fakes
    sampler = sampler_for([Server(a.url), Server(b.url)], tmp_path)
    sampler.sync(Policy(), version=0)
    ro = sampler.sample(PROMPTS, PARAMS, generator=torch.Generator().manual_seed(11))
    seeds = torch.randint(0, 2**31 - 1, (len(PROMPTS),), generator=torch.Generator().manual_seed(11)).tolist()
    asked_a, asked_b = a.asked("/v1/completions"), b.asked("/v1/completions")
    assert sorted(r.body["prompt"] for r in asked_a) == sorted([PROMPTS[0], PROMPTS[2]])  # prompt i on server i mod 2
    assert sorted(r.body["prompt"] for r in asked_b) == sorted([PROMPTS[1], PROMPTS[3]])
    by_prompt = {tuple(r.body["prompt"]): r.body for r in asked_a + asked_b}
    for p, seed in zip(PROMPTS, seeds):
        body = by_prompt[tuple(p)]
        assert body["seed"] == seed and body["n"] == 3 and body["logprobs"] == 0 and body["return_token_ids"] is True
        assert body["max_tokens"] == 5 and body["stop_token_ids"] == [0, 10, 20, 30, 40]
        assert body["model"] == "tiny-model"
    assert len(set(seeds)) == len(seeds)

    rows = expected_rows(a, PROMPTS, seeds, PARAMS)
    assert ro.group_size == 3 and ro.completion_ids.shape[0] == len(PROMPTS) * 3
    assert any(reason == "stop" for _, _, reason in rows) and any(reason == "length" for _, _, reason in rows)
    for k, (ids, lps, reason) in enumerate(rows):
        n = len(ids)
        assert int(ro.lengths[k]) == n
        assert ro.completion_ids[k, :n].tolist() == ids
        assert torch.allclose(ro.logp[k, :n], torch.tensor(lps))
        assert ro.completion_mask[k].sum() == n and ro.logp[k, n:].abs().sum() == 0
        assert bool(ro.truncated[k]) == (reason == "length")
        p = PROMPTS[k // 3]
        assert ro.prompt_ids[k, -len(p):].tolist() == p and ro.prompt_mask[k].sum() == len(p)
    sampler.close()


def test_sample_split_in_two_gives_the_same_rollout(fakes, tmp_path):
    a, b = fakes
    sampler = sampler_for([Server(a.url), Server(b.url)], tmp_path)
    sampler.sync(Policy(), version=0)
    G, N = PARAMS.group_size, len(PROMPTS)
    whole = sampler.sample(PROMPTS, PARAMS, generator=torch.Generator().manual_seed(5))
    asked_whole = sorted((tuple(r.body["prompt"]), r.body["seed"], u)
                         for u, f in (("a", a), ("b", b)) for r in f.asked("/v1/completions"))
    a.requests.clear()
    b.requests.clear()
    first = sampler.sample(PROMPTS[:1], PARAMS, generator=torch.Generator().manual_seed(5), rows=(0, N * G))
    rest = sampler.sample(PROMPTS[1:], PARAMS, generator=torch.Generator().manual_seed(5), rows=(G, N * G))
    asked_split = sorted((tuple(r.body["prompt"]), r.body["seed"], u)
                         for u, f in (("a", a), ("b", b)) for r in f.asked("/v1/completions"))
    assert asked_split == asked_whole  # the same seeds, each prompt on the same server
    T = whole.completion_ids.shape[1]
    for part, rows in ((first, slice(0, G)), (rest, slice(G, N * G))):
        t = part.completion_ids.shape[1]
        assert torch.equal(part.completion_ids, whole.completion_ids[rows, :t])
        assert whole.completion_ids[rows, t:].eq(0).all() and t <= T
        assert torch.equal(part.logp, whole.logp[rows, :t])
        assert torch.equal(part.truncated, whole.truncated[rows])
    sampler.close()


def test_a_wrong_number_of_choices_is_a_server_error(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path)
    sampler.sync(Policy(), version=0)
    fake.choices_delta = -1
    with pytest.raises(ServerError, match="asked for 3 completions, got 2") as e:
        sampler.sample(PROMPTS[:1], PARAMS, generator=torch.Generator().manual_seed(0))
    assert fake.url in str(e.value)
    fake.choices_delta = 1
    with pytest.raises(ServerError, match="asked for 3 completions, got 4"):
        sampler.sample(PROMPTS[:1], PARAMS, generator=torch.Generator().manual_seed(0))
    sampler.close()


def test_missing_token_ids_is_a_server_error(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path)
    sampler.sync(Policy(), version=0)
    fake.no_token_ids = True
    with pytest.raises(ServerError, match="return_token_ids"):
        sampler.sample(PROMPTS[:1], PARAMS, generator=torch.Generator().manual_seed(0))
    sampler.close()


def test_a_restart_during_sampling_is_caught_by_verify(fakes, tmp_path):
    a, b = fakes
    sampler = sampler_for([Server(a.url), Server(b.url)], tmp_path)
    sampler.sync(Policy(), version=0)
    sampler.sample(PROMPTS, PARAMS, generator=torch.Generator().manual_seed(0))  # fine
    b.restart_after_completions = 1
    with pytest.raises(ServerError) as e:
        sampler.sample(PROMPTS, PARAMS, generator=torch.Generator().manual_seed(0))
    assert b.url in str(e.value) and "'default'" in str(e.value) and "'run:1'" in str(e.value)
    assert "changed during the rollout" in str(e.value)
    sampler.close()


def test_a_dropped_completion_is_a_server_error(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path)
    sampler.sync(Policy(), version=0)
    fake.drop.add("/v1/completions")
    with pytest.raises(ServerError, match="completion request .* failed"):
        sampler.sample(PROMPTS[:1], PARAMS, generator=torch.Generator().manual_seed(0))
    sampler.close()


# --- the sync check ----------------------------------------------------------------------------


def test_the_sync_check_sees_the_servers_tokens_and_passes(fake, tmp_path):
    seen = []

    def check(policy, prompt, ids, lps):
        seen.append((policy, list(prompt), ids, lps))
        return False, 0.01, 0.5

    policy = Policy()
    sampler = sampler_for([Server(fake.url)], tmp_path, check=check, temperature=0.7)
    sampler.sync(policy, version=0)
    [(got, prompt, ids, lps)] = seen
    want_ids, want_lps, _ = fake.completion(CHECK_PROMPT, 0, 0, CHECK_TOKENS)
    assert got is policy and prompt == CHECK_PROMPT and ids == want_ids and lps == want_lps
    [req] = fake.asked("/v1/completions")
    assert req.body["n"] == 1 and req.body["ignore_eos"] is True and req.body["temperature"] == 0.7
    assert req.time > fake.asked("/resume")[-1].time  # after the sync, on the new weights
    assert sampler.last_check == {fake.url: 0.01}
    sampler.sync(policy, version=0)  # nothing pushed: nothing checked
    assert len(seen) == 1
    sampler.close()


def test_the_sync_check_failing_is_a_server_error_naming_the_gap(fake, tmp_path):
    sampler = sampler_for([Server(fake.url)], tmp_path, check=lambda *a: (True, 0.8125, 0.25))
    with pytest.raises(ServerError) as e:
        sampler.sync(Policy(), version=0)
    text = str(e.value)
    assert fake.url in text and "0.812" in text and "bound 0.25" in text and "processed_logprobs" in text
    assert sampler.last_check == {fake.url: 0.8125}
    sampler.close()


def test_the_call_speaks_http_1_1_with_json():
    """The fake answers as http.client expects: a sanity check of the fake itself."""
    with FakeVLLM() as fake:
        conn = http.client.HTTPConnection("127.0.0.1", fake.port, timeout=2)
        conn.request("POST", "/reset_prefix_cache", body=b"{}", headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and r.read() == b'{"success": true}'
        conn.close()
        assert fake.routes() == ["/reset_prefix_cache"] and fake.requests[0].body == {}


def test_the_sync_check_runs_on_every_rank_where_only_rank_0_pushes(fake, tmp_path):
    # under torchrun the trainer's forward may be collective (FSDP gathers each layer's shards): a check on
    # rank 0 alone would wait on the other ranks forever. Rank 1 here: rank 0's answer (server 0 stale) comes
    # by broadcast; rank 1 pushes nothing, takes part in the gathers, and checks as rank 0 does
    class Rank1:
        enabled, is_main = True, False
        told = []

        def broadcast_object(self, obj):
            self.told.append(obj)
            return [0]  # rank 0 found server 0 stale

        def barrier(self):
            self.told.append("barrier")

    seen = []
    sampler = sampler_for([Server(fake.url)], tmp_path, dist=Rank1(),
                          check=lambda *a: seen.append(a[2]) or (False, 0.0, 0.5))
    start = len(fake.requests)
    sampler.sync(Policy(), version=0)
    assert Rank1.told == [[], "barrier"]  # rank 1 asked nothing itself (an empty list), then waited for all
    assert routes_from(fake, start) == ["/v1/completions"]  # no pause, no push, no tag: the check's request
    assert len(seen) == 1 and sampler.tag == "run:1" and sampler.pushed_version == 0
    sampler.close()
