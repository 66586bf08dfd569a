"""--rollout-engine vllm-server, for real, on this CPU: vLLM's own OpenAI server over HTTP.

Runs in the vLLM environment (`.venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_server.py`);
skipped where vLLM is not installed. Starting a server takes ~50 s here, so the file starts few:
`servers` (module scope) starts two at once, A (the one most tests use) and B (the one the fault
tests kill, restart on its port and stop); B's restart is the third start. gspo starts its own
twice (the owned-server tests). Each server is its own process group (start_new_session), killed
whole at teardown: the API server and vLLM's engine process.

The sizes: --prompts-per-step 8 --group-size 4 is 8 * 4 = 32 sampled rows a step (the integrity
check's rows); --max-new-tokens 48 with the tiny model (max_position_embeddings 64, prompts ~10 tokens).
"""

import copy
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

import gspo
from gspo.io.files import read_jsonl

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except Exception:
    HAVE_VLLM = False

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (see docs/vllm.md)")]

TINY = Path(gspo.__file__).parent / "assets" / "tiny"
ENV = {**os.environ, "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "1"}
FAST = ["--prompts-per-step", "8", "--group-size", "4", "--eval-size", "0", "--no-progress", "--max-new-tokens", "48"]
START_DEADLINE = 300.0  # a server's /health (~50 s here, more when the machine is busy)
ROWS = 8 * 4  # --prompts-per-step 8 * --group-size 4: each step's sampled rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return r.status == 200
    except Exception:
        return False


class VServer:
    """One `vllm.entrypoints.openai.api_server` on 127.0.0.1:port in its own process group."""

    def __init__(self, model: Path, port: int, key: str, log: Path):
        self.model, self.port, self.key, self.log = model, port, key, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc = None
        self.env = {**ENV, "VLLM_API_KEY": key}  # the gspo subprocesses' environment

    def start(self):
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                "--logprobs-mode", "processed_logprobs", "--enable-prefix-caching", "--no-enable-chunked-prefill",
                "--enforce-eager", "--max-num-batched-tokens", "2048", "--seed", "0"]
        env = {**ENV, "VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": self.key}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        return self

    def wait_ready(self, deadline: float = START_DEADLINE):
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            assert self.proc.poll() is None, f"the server exited: {self.log.read_text()[-2000:]}"
            if healthy(self.url):
                return self
            time.sleep(0.5)
        self.kill()
        raise AssertionError(f"no /health from {self.url} within {deadline:g} s: {self.log.read_text()[-2000:]}")

    def signal(self, sig):
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self):
        if self.proc is not None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
            self.proc.wait(30)

    def running(self) -> float:
        """vLLM's gauges: requests running + waiting (the Prometheus /metrics route; no key)."""
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=2) as r:
                text = r.read().decode()
        except Exception:
            return 0.0
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    shutil.copytree(TINY, root / "tiny")
    shutil.copytree(TINY, root / "other-model")  # the same weights under another name: another model
    return root


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory):
    """A and B, started together (two of the file's three starts), with one random key (gspo gives all its
    servers VLLM_API_KEY's)."""
    logs, key = tmp_path_factory.mktemp("logs"), secrets.token_urlsafe(16)
    a = VServer(models / "tiny", free_port(), key, logs / "a.log").start()
    b = VServer(models / "tiny", free_port(), key, logs / "b.log").start()
    try:
        a.wait_ready()
        b.wait_ready()
        yield a, b
    finally:
        a.kill()
        b.kill()


@pytest.fixture()
def server(servers):
    return servers[0]


@pytest.fixture()
def spare(servers):
    b = servers[1]
    if b.proc.poll() is not None or not healthy(b.url):  # an earlier test left it down: a start more
        b.kill()
        b.start().wait_ready()
    return b


def gspo_cli(*args, env, popen=False):
    cmd = [sys.executable, "-m", "gspo", *map(str, args)]
    if popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def on(server, *extra):
    return ["--model", server.model, "--rollout-engine", "vllm-server", "--vllm-server-url", server.url, *extra]


def rows(run):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in read_jsonl(run / "metrics.jsonl")]


def plan_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("plan:"))


def one_line_error(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gspo train: error: "), stderr[-3000:]
    return lines[0]


def wait_rows(run, n, proc, deadline=300.0):
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if (run / "metrics.jsonl").exists() and len(read_jsonl(run / "metrics.jsonl")) >= n:
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    raise AssertionError(f"{run}: no {n} metrics rows within {deadline:g} s")


@pytest.fixture(scope="module")
def first_run(servers, tmp_path_factory):
    """3 steps against A (test 1 checks it; test 5 resumes it with a second server)."""
    a = servers[0]
    run = tmp_path_factory.mktemp("first") / "run"
    return run, gspo_cli("train", *on(a, *FAST), "--steps", "3", "--output-dir", run, env=a.env)


# --- 1. a run against the server ---------------------------------------------------------------


@pytest.mark.slow
def test_a_run_trains_on_the_server(server, first_run):
    run, r = first_run
    assert r.returncode == 0, r.stderr[-3000:]
    plan = plan_line(r.stdout)
    assert f"{server.url} ({server.model}, vLLM 0.32" in plan, plan
    m = rows(run)
    assert [x["step"] for x in m] == [1, 2, 3]
    assert all(x["integrity/breaches"] == 0 for x in m), [x["integrity/breaches"] for x in m]
    assert all(x["integrity/rows_checked"] == ROWS for x in m)  # every sampled row checked: 8 prompts * 4
    assert all(x["completion/max_length"] <= 48 for x in m)


# --- 2. the sync check -------------------------------------------------------------------------


def two_versions(server, seed: int):
    """The served model (its tokenizer) and a copy perturbed by 5% of each weight's mean size (seeded),
    and the server connected: (base, tokenizer, perturbed, servers, deadlines)."""
    from gspo.models.loading import load_policy
    from gspo.sampling import vllm_server as vs

    base, tok = load_policy(str(server.model))
    perturbed = copy.deepcopy(base)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=g))
    deadlines = vs.Deadlines(request=60, sync=120, start=60)
    servers = vs.servers_from([server.url], key=server.key)
    vs.connect(servers, model=str(server.model), needed_len=64, deadlines=deadlines)
    return base, tok, perturbed, servers, deadlines


@pytest.mark.slow
def test_the_server_samples_the_pushed_weights_and_the_check_catches_other_weights(server, tmp_path):
    from gspo.models.logprobs import completion_logprobs
    from gspo.sampling import vllm_server as vs
    from gspo.sampling.rollout import sampling_params

    base, tok, perturbed, servers, deadlines = two_versions(server, seed=0)

    def check(model, prompt, ids, logps):  # the trainer's forward of the server's tokens; per-token bound 1e-4
        full = torch.tensor([list(prompt) + list(ids)])
        with torch.no_grad():
            mine = completion_logprobs(model, full, torch.ones_like(full), torch.ones((1, len(ids))))[0]
        gap = float((mine - torch.tensor(logps)).abs().max())
        return gap > 1e-4, gap, 1e-4

    sampler = vs.ServerSampler(servers, vs.DirectoryPush(tmp_path / "weights", torch.float32), deadlines,
                               run_id="sync-check", check=check)
    try:
        sampler.sync(perturbed, version=1)  # the push, then the check (raises past 1e-4 a token)
        assert sampler.last_check[server.url] < 1e-4
        assert servers[0].weights == "sync-check:1"
        prompts = [tok(p)["input_ids"] for p in ["12+7=", "999-123=", "5+5=", "40+2="]]
        params = sampling_params(tok, group_size=4, max_new_tokens=8)
        ro = sampler.sample(prompts, params, generator=torch.Generator().manual_seed(0))
        assert ro.completion_ids.shape[0] == 16  # 4 prompts * 4
        with torch.no_grad():
            mine = completion_logprobs(perturbed, ro.input_ids, ro.attention_mask, ro.completion_mask)
            theirs = completion_logprobs(base, ro.input_ids, ro.attention_mask, ro.completion_mask)
        m = ro.completion_mask.bool()
        assert (mine - ro.logp)[m].abs().max() < 1e-4  # float32, the same mathematics: ~1e-6 measured
        assert (theirs - ro.logp)[m].abs().max() > 1e-2  # the perturbation is visible: the server holds it

        # a server holding other weights: the perturbed model goes over, the check's trainer is the base
        class OtherWeights(vs.DirectoryPush):
            def push(self, policy, *a, **k):
                super().push(perturbed, *a, **k)

        wrong = vs.ServerSampler(servers, OtherWeights(tmp_path / "other", torch.float32), deadlines,
                                 run_id="sync-check-wrong", check=check)
        try:
            with pytest.raises(vs.ServerError, match=f"vLLM server {server.url}: after the sync its log-probs"):
                wrong.sync(base, version=1)
            assert wrong.last_check[server.url] > 1e-2
        finally:
            wrong.close()
    finally:
        sampler.close()


# --- a served teacher's log-probs (on-policy distillation) ---------------------------------------


def post(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"{server.url}{path}", json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {server.key}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.slow
def test_a_served_teacher_scores_tokens_as_the_local_model_does(server, tmp_path):
    """ServedTeacher.logprobs against a plain float32 forward (log_softmax of the logits, temperature 1)
    of the weights the server holds (pushed here: other tests push theirs), to 1e-4 a token; and what
    the module docstring says of vLLM 0.32, asked of the real server."""
    from gspo.sampling import vllm_server as vs
    from gspo.sampling.teacher_server import ServedTeacher, TeacherError

    _, tok, perturbed, servers, deadlines = two_versions(server, seed=1)
    sampler = vs.ServerSampler(servers, vs.DirectoryPush(tmp_path / "weights", torch.float32), deadlines,
                               run_id="teacher")
    try:
        sampler.sync(perturbed, version=1)
    finally:
        sampler.close()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, len(tok), (n,), generator=g).tolist() for n in (2, 9, 30, 63, 63, 47)]
    starts = [1, 1, 12, 1, 40, 46]
    teacher = ServedTeacher(f"{server.url}/v1", timeout=60, concurrency=4, key=server.key)
    teacher.check(tok)  # /tokenize, /detokenize and a scored probe, on the real routes
    got = teacher.logprobs(seqs, starts)
    for seq, s, lp in zip(seqs, starts, got):
        with torch.no_grad():
            logits = perturbed(torch.tensor([seq])).logits[0].float()  # (L, V)
        logp = torch.log_softmax(logits, dim=-1)  # (L, V) temperature 1
        mine = logp[torch.arange(s - 1, len(seq) - 1), torch.tensor(seq[s:])]  # (L - s,) log p(seq[j] | seq[:j])
        assert len(lp) == len(seq) - s and (mine - torch.tensor(lp)).abs().max() < 1e-4, (s, len(seq))

    # vLLM 0.32, as the docstring says: the request's temperature does not touch prompt log-probs (raw);
    # max_tokens 0 is refused; a prompt of max_model_len tokens is refused (the generated token does not fit)
    body = {"model": teacher.model, "prompt": seqs[2], "max_tokens": 1, "prompt_logprobs": 0}
    hot = [post(server, "/v1/completions", {**body, "temperature": t})[1]["choices"][0]["prompt_logprobs"]
           for t in (0.0, 0.3, 1.7)]
    assert hot[0] == hot[1] == hot[2] and hot[0][0] is None and list(hot[0][5]) == [str(seqs[2][5])]
    assert post(server, "/v1/completions", {**body, "max_tokens": 0})[0] == 400
    assert post(server, "/v1/completions", {**body, "prompt": [3] * 64})[0] == 400
    with pytest.raises(TeacherError, match="max_model_len 64"):
        teacher.logprobs([[3] * 64], [1])


# --- 6. refusals before step 1 ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("case", ["nobody", "path", "other-model", "wrong-key"])
def test_a_wrong_server_is_refused_before_step_1(server, models, tmp_path, case):
    run = tmp_path / "run"
    url, model, env = server.url, server.model, server.env
    if case == "nobody":
        url = f"http://127.0.0.1:{free_port()}"
    elif case == "path":
        url = f"{server.url}/v1"
    elif case == "other-model":
        model = models / "other-model"
    else:
        env = {**server.env, "VLLM_API_KEY": "not-the-key"}
    r = gspo_cli("train", "--model", model, "--rollout-engine", "vllm-server", "--vllm-server-url", url, *FAST,
                 "--steps", "1", "--output-dir", run, env=env)
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-3000:])
    line = one_line_error(r.stderr)
    expected = {"nobody": f"vLLM server {url}: /health failed (",
                "path": f"vllm_server_url: '{url}' is not a server's address",
                "other-model": f"vLLM server {url} serves '{server.model}', and this run trains",
                "wrong-key": "refused the API key (401)"}[case]
    assert expected in line, line
    assert not (run / "metrics.jsonl").exists() or not read_jsonl(run / "metrics.jsonl")  # nothing trained


# --- 3. a server killed mid-rollout; the run resumes on its restart ------------------------------


@pytest.mark.slow
def test_a_server_killed_mid_rollout_stops_the_run_and_it_resumes_exactly(server, spare, tmp_path):
    args = [*FAST, "--steps", "4", "--save-every", "1", "--vllm-server-timeout", "20",
            "--vllm-server-sync-timeout", "20"]
    ref = tmp_path / "ref"  # the uninterrupted run, on A
    r = gspo_cli("train", *on(server, *args), "--output-dir", ref, env=server.env)
    assert r.returncode == 0, r.stderr[-3000:]
    # (a rollout here lasts ~0.9-1.6 s with its sync: the tiny model's completions end at EOS after ~4 tokens
    # whatever --max-new-tokens; --min-new-tokens would lengthen them: test_min_new_tokens_on_the_server_trains)

    killed = tmp_path / "killed"  # the same run, on B
    p = gspo_cli("train", *on(spare, *args), "--output-dir", killed, env=spare.env, popen=True)
    try:
        wait_rows(killed, 2, p)  # steps 1 and 2 done (and saved: --save-every 1)
        end = time.monotonic() + 60
        while spare.running() < 2 and time.monotonic() < end:  # step 3's rollout: its n=4 requests in flight
            time.sleep(0.01)
        spare.signal(signal.SIGKILL)  # the API server and its engine, mid-rollout
        t0 = time.monotonic()
        out, err = p.communicate(timeout=20 + 60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    spare.proc.wait(30)
    assert p.returncode == 2, err[-3000:]
    assert took < 20 + 10, took  # --vllm-server-timeout 20 (a refused connection fails at once) + 10 s to exit
    line = one_line_error(err)
    assert line.startswith(f"gspo train: error: vLLM server {spare.url}: a completion request"), line
    assert line.endswith(f"gspo train --resume {killed}"), line
    assert "from its last checkpoint" in line
    assert [x["step"] for x in rows(killed)] == [1, 2]

    spare.start().wait_ready()  # the same port (the third start)
    r = gspo_cli("train", "--resume", killed, env=spare.env)
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = rows(killed), rows(ref)
    assert [x["step"] for x in got] == [1, 2, 3, 4]
    assert all(x["integrity/breaches"] == 0 for x in got)
    diff = {(x["step"], k): (x[k], y.get(k)) for x, y in zip(got, want) for k in x if x[k] != y.get(k)}
    assert not diff, diff  # steps 1-2 as the reference's (A and B sample alike), 3-4 resumed from step 2


# --- 5. a second server added at resume ---------------------------------------------------------


@pytest.mark.slow
def test_a_second_server_is_added_at_resume(server, spare, first_run):
    run, first = first_run
    assert first.returncode == 0, first.stderr[-3000:]
    r = gspo_cli("train", "--resume", run, "--steps", "4", "--vllm-server-url", server.url,
                 "--vllm-server-url", spare.url, env=server.env)
    assert r.returncode == 0, r.stderr[-3000:]
    plan = plan_line(r.stdout)
    assert "2 vLLM servers" in plan and server.url in plan and spare.url in plan, plan
    m = rows(run)
    assert [x["step"] for x in m] == [1, 2, 3, 4] and m[-1]["integrity/breaches"] == 0
    assert m[-1]["integrity/rows_checked"] == ROWS  # 8 prompts over 2 servers (4 each), 32 rows


# --- 4. a slowed (stopped) server -----------------------------------------------------------------


@pytest.mark.slow
def test_a_stopped_server_stops_the_run_within_the_deadline(spare, tmp_path):
    timeout, margin = 10, 10
    run = tmp_path / "run"
    p = gspo_cli("train", *on(spare, *FAST), "--steps", "4", "--save-every", "1", "--vllm-server-timeout", timeout,
                 "--vllm-server-sync-timeout", timeout, "--output-dir", run, env=spare.env, popen=True)
    try:
        wait_rows(run, 1, p)
        spare.signal(signal.SIGSTOP)  # the server hangs: connections are accepted (the kernel), nothing answers
        t0 = time.monotonic()
        out, err = p.communicate(timeout=timeout + 60)
        took = time.monotonic() - t0
    finally:
        spare.signal(signal.SIGCONT)
        if p.poll() is None:
            p.kill()
    assert p.returncode == 2, err[-3000:]
    line = one_line_error(err)
    assert line.startswith(f"gspo train: error: vLLM server {spare.url}: ") and f"within {timeout} s" in line, line
    assert line.endswith(f"gspo train --resume {run}"), line
    assert took < timeout + margin, (took, line)
    end = time.monotonic() + 60
    while not healthy(spare.url) and time.monotonic() < end:  # continued, it answers again
        time.sleep(0.5)
    assert healthy(spare.url)


# --- 7, 8. a server gspo starts ------------------------------------------------------------------


def descendants(pid: int) -> dict[int, str]:
    """The processes under `pid` now: pid -> command line."""
    parent, cmd = {}, {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
                cmd[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, ValueError, IndexError):
                pass
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        for c, pp in parent.items():
            if pp == p and c not in found:
                found[c] = cmd.get(c, "")
                todo.append(c)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def with_port(port: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                line = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "vllm.entrypoints.openai.api_server" in line and f"--port {port} " in line + " " and alive(int(d.name)):
                out.append(int(d.name))
    return out


def owned_server_of(p, run, deadline=300.0):
    """The server gspo started: (its processes, its port), once it samples (a metrics row written)."""
    wait_rows(run, 1, p, deadline)
    kids = descendants(p.pid)
    api = [c for c, line in kids.items() if "vllm.entrypoints.openai.api_server" in line]
    assert len(api) == 1, kids
    argv = kids[api[0]].split()
    return kids, argv[argv.index("--port") + 1]


@pytest.mark.slow
def test_an_agent_run_on_a_server_gspo_starts_and_stops(tmp_path):
    # 8: the calculator agent (examples/agents) over gspo's OpenAI endpoint, the server behind it;
    # 7: no --vllm-server-url: gspo starts its own (tiny-tool, the task's model) and stops it whole (the API
    # server and its engine: no process of it left; one test for both, a server start costs ~60 s here)
    run = tmp_path / "run"
    agent = f"{Path(__file__).parents[1] / 'examples' / 'agents' / 'calculator_agent.py'}:rollout"
    env = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    p = gspo_cli("train", "--task", "calculator", "--env", agent, "--prompts-per-step", "8", "--group-size", "4",
                 "--eval-size", "0", "--no-progress", "--steps", "2", "--rollout-engine", "vllm-server",
                 "--output-dir", run, env=env, popen=True)
    try:
        kids, port = owned_server_of(p, run)
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-3000:]
    assert "a vLLM server gspo started here" in plan_line(out)
    assert "agent rollout() over an OpenAI endpoint on 127.0.0.1" in out
    m = rows(run)
    assert len(m) == 2 and all(x["integrity/breaches"] == 0 for x in m), [x["integrity/breaches"] for x in m]
    assert all(x["agent/failed_frac"] == 0.0 for x in m)
    assert m[0]["episode/turns"] > 1.0 and m[0]["episode/tool_calls"] > 0
    left = [k for k in kids if alive(k)] + with_port(port)
    assert not left, {k: kids.get(k, "") for k in left}


@pytest.mark.slow
def test_a_killed_trainer_takes_its_server_with_it(tmp_path):
    run = tmp_path / "run"
    p = gspo_cli("train", "--model", "tiny", "--rollout-engine", "vllm-server", *FAST, "--steps", "50",
                 "--output-dir", run, env=ENV, popen=True)
    kids = {}
    try:
        kids, port = owned_server_of(p, run)
        p.send_signal(signal.SIGKILL)  # no cleanup of its own: PR_SET_PDEATHSIG (and vLLM's shutdown) only
        p.communicate(timeout=30)
        end = time.monotonic() + 20
        while ([k for k in kids if alive(k)] or with_port(port)) and time.monotonic() < end:
            time.sleep(0.2)
        left = {k: kids[k] for k in kids if alive(k)}
        assert not left and not with_port(port), left
    finally:
        if p.poll() is None:
            p.kill()
        for k in kids:  # whatever is left, gone (their groups: the server's session)
            if alive(k):
                try:
                    os.killpg(os.getpgid(k), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass



@pytest.mark.slow
def test_min_new_tokens_on_the_server_trains(server, tmp_path):
    run = tmp_path / "run"
    r = gspo_cli("train", *on(server, *FAST), "--min-new-tokens", "8", "--steps", "1", "--output-dir", run,
                 env=server.env)
    assert r.returncode == 0, r.stderr[-1000:]
    assert rows(run)[0]["integrity/breaches"] == 0


# --- generations that span a weight sync (--partial-rollouts) --------------------------------------


@pytest.mark.slow
def test_a_generation_spanning_a_sync_records_each_tokens_version_as_the_real_server_sampled_it(server, tmp_path):
    """A rollout under way when new weights are pushed with --partial-rollouts: vLLM aborts it, gspo
    continues each completion under the new weights. Every token's log-prob must be its own
    version's: the trainer's forward of the whole sequence under the base weights (version 0) for
    the tokens marked 0, under the perturbed ones (version 1) for those marked 1, to 1e-4 a token."""
    from gspo.models.logprobs import completion_logprobs
    from gspo.sampling import vllm_server as vs
    from gspo.sampling.rollout import sampling_params

    base, tok, perturbed, servers, deadlines = two_versions(server, seed=1)
    prompts = [tok(f"{a}+{b}=")["input_ids"] for a in range(10, 74) for b in (3,)]  # 64 prompts x 4: 256 rows
    params = sampling_params(tok, group_size=4, max_new_tokens=64 - max(map(len, prompts)))
    ro = None
    for attempt in range(4):  # the push must land while the rows generate (~1 s of them here)
        sampler = vs.ServerSampler(servers, vs.DirectoryPush(tmp_path / f"w{attempt}", torch.float32), deadlines,
                                   run_id=f"partial-{attempt}", partial=True)
        try:
            sampler.sync(base, version=0)
            out = {}
            thread = threading.Thread(target=lambda out=out, sampler=sampler, seed=attempt: out.update(
                ro=sampler.sample(prompts, params, generator=torch.Generator().manual_seed(seed))))
            thread.start()
            end = time.monotonic() + 30
            while server.running() == 0 and time.monotonic() < end:
                time.sleep(0.002)
            sampler.sync(perturbed, version=1)
            thread.join(120)
            ro = out["ro"]
        finally:
            sampler.close()
        m = ro.completion_mask.bool()
        v0, v1 = m & ro.versions.eq(0), m & ro.versions.eq(1)
        if (v0.any(1) & v1.any(1)).any():  # a completion begun under version 0 and ended under 1
            break
    assert (v0.any(1) & v1.any(1)).any(), "no completion spanned the sync in 4 tries"
    assert sampler.continued > 0
    assert bool((ro.versions[:, 1:] >= ro.versions[:, :-1]).logical_or(~m[:, 1:]).all())  # versions only move on
    with torch.no_grad():
        under0 = completion_logprobs(base, ro.input_ids, ro.attention_mask, ro.completion_mask)
        under1 = completion_logprobs(perturbed, ro.input_ids, ro.attention_mask, ro.completion_mask)
    assert (under0 - ro.logp)[v0].abs().max() < 1e-4  # float32: ~1e-6 measured
    assert (under1 - ro.logp)[v1].abs().max() < 1e-4
    assert (under0 - ro.logp)[v1].abs().max() > 1e-2  # the versions are told apart: the perturbation shows


@pytest.mark.slow
def test_partial_rollouts_train_while_the_server_samples_and_resume(server, tmp_path):
    """--max-staleness 1 --partial-rollouts: 4 steps with a checkpoint at 2 (the batch sampled ahead
    saved with its per-token versions), then the run resumed from step 2 to 4."""
    run = tmp_path / "run"
    args = [*on(server, *FAST), "--max-staleness", "1", "--partial-rollouts", "--output-dir", run]
    r = gspo_cli("train", *args, "--steps", "2", env=server.env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sampled by the servers while the trainer trains" in r.stdout and "(partial rollouts)" in r.stdout, r.stdout
    r = gspo_cli("train", "--resume", run, "--steps", "4", env=server.env)
    assert r.returncode == 0, r.stderr[-3000:]
    m = rows(run)
    assert [x["step"] for x in m] == [1, 2, 3, 4]
    assert all(x["integrity/breaches"] == 0 for x in m)
    assert all(0 <= x["async/staleness_max"] <= 1 and 0 <= x["async/spanning_rows"] <= 1 for x in m)
    assert m[0]["async/staleness_max"] == 0  # batch 1: version 0, the only one there is


@pytest.mark.slow
@pytest.mark.parametrize("partial", [True, False], ids=["abort", "wait"])
def test_a_sync_during_a_big_round_does_not_deadlock_on_a_real_server(server, tmp_path, partial):
    """300 prompts (more than the 64 requests in flight) and a sync under way: neither waits for the other
    to a deadline (found by a breaker: before the gate's tickets, the sync and the sample held each other
    until the 20 s request deadline, in both modes), and every token is its version's."""
    from gspo.models.loading import load_policy
    from gspo.sampling import vllm_server as vs
    from gspo.sampling.rollout import SamplingParams
    from gspo.sampling.vllm_server import Deadlines, ServerError
    from tests.test_server_partial import sample_in_thread

    policy, _ = load_policy(str(server.model))
    servers = vs.servers_from([server.url], key=server.key)
    vs.connect(servers, model=str(server.model), needed_len=64, deadlines=Deadlines(request=120, sync=120))
    sampler = vs.ServerSampler(servers, vs.DirectoryPush(tmp_path / "w", torch.float32),
                               Deadlines(request=120, sync=240), run_id=f"big-{partial}", partial=partial)
    params = SamplingParams(group_size=1, max_new_tokens=40, stop_token_ids=(), pad_token_id=0)
    try:
        sampler.sync(policy, version=0)  # (a first sync probes the server: slow on a busy machine)
        sampler.deadlines = Deadlines(request=20, sync=60)
        thread, out = sample_in_thread(sampler, prompts=[[1 + i % 7, 2, 3] for i in range(300)], params=params)
        end = time.monotonic() + 60
        while server.running() == 0 and time.monotonic() < end:
            time.sleep(0.01)
        t0 = time.monotonic()
        error = None
        try:
            sampler.sync(policy, version=1)
        except ServerError as e:
            error = e
        thread.join(120)
        took = time.monotonic() - t0
    finally:
        sampler.close()
    # before the fix: one of them was cut by the 20 s request deadline (no answer to a completion request within 20 s)
    assert error is None and "error" not in out, (took, error, out.get("error"))
