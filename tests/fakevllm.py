"""A fake vLLM OpenAI-compatible server (stdlib only) for gspo.sampling.vllm_server's client.

It speaks the routes gspo drives, answering as vLLM 0.32 does (measured on a real server):

    GET  /health                  -> 200, empty body
    GET  /version                 -> {"version": "0.32.0"}
    GET  /v1/models               -> {"data": [{"id": MODEL, "max_model_len": 64, ...}]}  (Bearer key checked: 401)
    GET  /weight_info             -> {"weight_version": "default"}                       (dev routes: no key)
    GET  /server_info             -> {"vllm_config": "model='...', ..., device_config=cpu, ..."}
    POST /pause?mode=wait         -> {"status": "paused"}
    POST /resume                  -> {"status": "resumed"}
    POST /collective_rpc          -> {"results": [null]}     (reload_weights: the path is kept in `reloads`)
    POST /reset_prefix_cache      -> {"success": true}
    POST /update_weight_version   -> {}                      (the tag /weight_info reports from then on)
    POST /v1/completions          -> {"choices": [{"index", "token_ids", "logprobs": {"token_logprobs"},
                                                   "finish_reason", "prompt_logprobs"}, ...]}
    POST /tokenize                -> {"count", "max_model_len", "tokens", "token_strs"}  (the fake's `tokenizer`)
    POST /detokenize              -> {"prompt"}

The "model" is deterministic: completion i of a prompt, token j is (sum(prompt) + seed + i + j) % vocab,
its log-prob `token_logp(token)`; a completion ends at a stop token (kept, finish_reason "stop"),
else after max_tokens ("length"). `FakeVLLM.completion(...)` gives what the server answers.
With "prompt_logprobs": k, each choice has vLLM's prompt_logprobs: None for the first prompt token, then
for token j a dict {"<id>": {"logprob", "rank", "decoded_token"}} holding prompt[j] at the same log-prob
a sampled token gets (`token_logp`, less 0.001 a reload), and the k tokens of highest token_logp.
Its tokenizer (`tokenizer`, default CharTokenizer(vocab)) answers /tokenize and /detokenize; a request
naming a model the fake does not serve (`model`, `more_models`) is answered 404, as vLLM's.

Every request is recorded (`requests`: path with its query, method, JSON body, headers, arrival time).
Faults, set as attributes (any time, also while serving; routes are named without their query):

    delay = {"/health": 3.0}           # sleep before answering (cut short when the server closes)
    status = {"/weight_info": 404}     # answer this status (with a short JSON error body)
    not_json = {"/version"}            # answer 200 with a body that is not JSON
    drop = {"/v1/completions"}         # close the connection without answering
    trickle = {"/health": (0.05, 2.0)} # headers, then one body byte per 0.05 s (a long Content-Length)
                                       # for 2.0 s at most (None: until the client goes or the server closes)
    choices_delta = -1                 # answer n + delta choices
    no_token_ids = True                # choices without token_ids
    restart_after_completions = 1      # after that many completion answers the weight version is "default"
    token_seconds = 0.01               # each generated token takes this long (0: answers at once)
    no_prompt_logprobs = True          # choices without prompt_logprobs
    shifted_prompt_logprobs = True     # entry j holds token j+1's log-prob (misaligned), the last one None

Weights and pauses, as vLLM's: each reload_weights is a new generation of the weights, and a token's
log-prob is token_logp(token) - 0.001 * generation (`generation_of(token, logp)` reads it back). While
paused, a completion that arrives waits for /resume before it starts. /pause?mode=wait waits for the
completions under way to finish; /pause?mode=abort ends them at once with the tokens they have,
finish_reason "abort" (token_seconds > 0 makes them last long enough to be caught).
    key = "secret"                     # /v1 routes want "Authorization: Bearer secret"
    model, max_model_len, device       # what /v1/models and /server_info report

Use it as a context manager: `with FakeVLLM() as fake: Server(fake.url) ...`.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Request:
    path: str  # with its query (/pause?mode=wait)
    method: str
    body: object  # the JSON body (None: none, or not JSON: the raw bytes)
    headers: dict
    time: float  # time.monotonic() when it arrived

    @property
    def route(self) -> str:
        return urllib.parse.urlsplit(self.path).path


def token_logp(token: int) -> float:
    return -0.1 * (token % 7 + 1)


class CharTokenizer:
    """The fake's default tokenizer, one token per character: id ord(c) % n, its string chr(0x100 + id)
    (the few methods gspo asks of a Hugging Face tokenizer)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % self.n for c in text]

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(0x100 + i) for i in ids]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(0x100 + i) for i in ids if 0 <= i < self.n)


def generation_of(token: int, logp: float) -> int:
    """Which reload of the fake's weights sampled `token` (its log-prob says: 0 before the first)."""
    return round((token_logp(token) - logp) / 0.001)


@dataclass
class FakeVLLM:
    model: str = "tiny-model"
    max_model_len: int = 64
    vocab: int = 50
    key: str | None = None
    version: str = "0.32.0"
    device: str = "cpu"
    weight_version: str = "default"
    delay: dict = field(default_factory=dict)
    status: dict = field(default_factory=dict)
    not_json: set = field(default_factory=set)
    drop: set = field(default_factory=set)
    trickle: dict = field(default_factory=dict)
    choices_delta: int = 0
    no_token_ids: bool = False
    restart_after_completions: int | None = None
    requests: list = field(default_factory=list)
    reloads: list = field(default_factory=list)  # the weights_path of every reload_weights
    paused: bool = False
    token_seconds: float = 0.0
    more_models: list = field(default_factory=list)  # other models /v1/models lists after `model`
    tokenizer: object = None  # encode, convert_ids_to_tokens, decode, len (None: CharTokenizer(vocab))
    no_prompt_logprobs: bool = False
    shifted_prompt_logprobs: bool = False

    def __post_init__(self):
        if self.tokenizer is None:
            self.tokenizer = CharTokenizer(self.vocab)
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._local = threading.local()
        self._running = 0  # completions under way
        self._aborts = 0  # /pause?mode=abort calls so far
        self._stop = threading.Event()
        self._completions = 0
        self._httpd = None
        self._thread = None

    # --- the model ---

    def completion(self, prompt, seed: int, i: int, max_tokens: int, stop=(), aborts: int | None = None):
        """Completion i of `prompt`: (token ids, log-probs, finish_reason). aborts: the /pause?mode=abort
        count when it started (a later abort ends it, "abort")."""
        ids, lps, s = [], [], sum(prompt)
        for j in range(max_tokens):
            if self.token_seconds and self._stop.wait(self.token_seconds):
                break
            with self._cond:
                if aborts is not None and self._aborts != aborts:
                    return ids, lps, "abort"
                t = (s + seed + i + j) % self.vocab
                ids.append(t)
                lps.append(token_logp(t) - 0.001 * len(self.reloads))
            if t in stop:
                return ids, lps, "stop"
        return ids, lps, "length"

    # --- serving ---

    @property
    def port(self) -> int:  # kept once closed (a test's assertions name its url)
        return self._httpd.server_address[1] if self._httpd is not None else self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeVLLM:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                fake._handle(self, "GET")

            def do_POST(self):
                fake._handle(self, "POST")

        class Server(ThreadingHTTPServer):
            request_queue_size = 256  # the listen backlog: a sampler opens up to 64 connections at once (stdlib: 5)
            daemon_threads = True

        self._httpd = Server(("127.0.0.1", 0), Handler)
        self._port = self._httpd.server_address[1]
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True, name="fakevllm")
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> FakeVLLM:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def routes(self) -> list[str]:
        """The routes asked, in order (with their query)."""
        with self._lock:
            return [r.path for r in self.requests]

    def asked(self, route: str) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.route == route]

    # --- one request ---

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        h.close_connection = True
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            body = raw
        route = urllib.parse.urlsplit(h.path).path
        with self._lock:
            self.requests.append(Request(h.path, method, body, dict(h.headers), time.monotonic()))
        if route in self.delay and self._stop.wait(self.delay[route]):
            return
        if route in self.drop:
            return  # the connection closes with no answer
        if route in self.trickle:
            self._trickle(h, *self.trickle[route])
            return
        if route in self.status:
            self._send(h, self.status[route], {"error": f"fake status {self.status[route]}"})
            return
        if route in self.not_json:
            self._send_raw(h, 200, b"<html>not json</html>", "text/html")
            return
        if route.startswith("/v1") and self.key is not None \
                and h.headers.get("Authorization") != f"Bearer {self.key}":
            self._send(h, 401, {"error": "Unauthorized"})
            return
        try:
            self._local.query = urllib.parse.urlsplit(h.path).query  # this request's (its thread's own)
            status, answer = self._answer(method, route, body)
        except Exception as e:  # a request the fake cannot answer: a 400, as a server would
            status, answer = 400, {"error": f"{type(e).__name__}: {e}"}
        if answer is None:
            self._send_raw(h, status, b"", "application/json")
        else:
            self._send(h, status, answer)

    def _answer(self, method: str, route: str, body):
        if method == "GET":
            if route == "/health":
                return 200, None
            if route == "/version":
                return 200, {"version": self.version}
            if route == "/v1/models":
                return 200, {"object": "list", "data": [
                    {"id": m, "object": "model", "owned_by": "vllm", "root": m, "max_model_len": self.max_model_len}
                    for m in [self.model, *self.more_models]]}
            if route == "/weight_info":
                return 200, {"weight_version": self.weight_version}
            if route == "/server_info":
                return 200, {"vllm_config": f"model='{self.model}', dtype=torch.float32, "
                                            f"device_config={self.device}, seed=0"}
        else:
            if isinstance(body, dict) and body.get("model") not in (None, self.model, *self.more_models):
                return 404, {"error": {"message": f"The model `{body['model']}` does not exist.",
                                       "type": "NotFoundError", "code": 404}}
            if route == "/tokenize":
                ids = self.tokenizer.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
                strs = self.tokenizer.convert_ids_to_tokens(ids) if body.get("return_token_strs") else None
                return 200, {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                             "token_strs": strs}
            if route == "/detokenize":
                return 200, {"prompt": self.tokenizer.decode(body["tokens"])}
            if route == "/pause":
                with self._cond:
                    self.paused = True
                    if "mode=abort" in getattr(self._local, "query", ""):
                        self._aborts += 1
                    self._cond.wait_for(lambda: self._running == 0, 60)  # the generations under way end
                return 200, {"status": "paused"}
            if route == "/resume":
                with self._cond:
                    self.paused = False
                    self._cond.notify_all()
                return 200, {"status": "resumed"}
            if route == "/collective_rpc":
                if body.get("method") == "reload_weights":
                    with self._cond:
                        self.reloads.append(body["kwargs"]["weights_path"])
                return 200, {"results": [None]}
            if route == "/reset_prefix_cache":
                return 200, {"success": True}
            if route == "/update_weight_version":
                self.weight_version = body["new_version"]
                return 200, None
            if route == "/v1/completions":
                return 200, self._complete(body)
        return 404, {"detail": "Not Found"}

    def _complete(self, body: dict) -> dict:
        prompt, n, seed = body["prompt"], int(body.get("n", 1)), int(body.get("seed") or 0)
        if len(prompt) + int(body["max_tokens"]) > self.max_model_len:
            raise ValueError("longer than max_model_len")
        stop = () if body.get("ignore_eos") else tuple(body.get("stop_token_ids") or ())
        with self._cond:  # a paused server starts nothing until /resume
            self._cond.wait_for(lambda: not self.paused, 60)
            self._running += 1
            aborts = self._aborts
        try:
            made = [self.completion(prompt, seed, i, int(body["max_tokens"]), stop, aborts)
                    for i in range(max(0, n + self.choices_delta))]
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()
        choices = []
        scored = self._prompt_logprobs(prompt, body.get("prompt_logprobs"))
        for i, (ids, lps, reason) in enumerate(made):
            logprobs = {"token_logprobs": lps, "tokens": [f"token_id:{t}" for t in ids]}
            choice = {"index": i, "text": "", "logprobs": logprobs, "finish_reason": reason, "token_ids": ids,
                      "prompt_logprobs": scored, "prompt_token_ids": None}
            if self.no_token_ids:
                del choice["token_ids"]
            if self.no_prompt_logprobs:
                del choice["prompt_logprobs"]
            choices.append(choice)
        with self._lock:
            self._completions += 1
            if self.restart_after_completions is not None and self._completions >= self.restart_after_completions:
                self.weight_version = "default"
        return {"id": "cmpl-fake", "object": "text_completion", "model": self.model, "choices": choices}

    def _prompt_logprobs(self, prompt: list[int], k) -> list | None:
        """vLLM's prompt_logprobs for `prompt` (None when not asked): each token's, then the k best."""
        if k is None:
            return None
        logp = {t: token_logp(t) - 0.001 * len(self.reloads) for t in range(self.vocab)}
        best = sorted(range(self.vocab), key=lambda t: (-logp[t], t))
        rank = {t: r + 1 for r, t in enumerate(best)}

        entries = {}  # token -> its entry, made once a request

        def entry(t: int) -> dict:
            if t not in entries:
                [s] = self.tokenizer.convert_ids_to_tokens([t])
                entries[t] = {"logprob": logp.get(t, token_logp(t)), "rank": rank.get(t, self.vocab),
                              "decoded_token": s}
            return entries[t]

        out = [None] + [{str(t): entry(t) for t in [p, *best[:int(k)]]} for p in prompt[1:]]
        return out[1:] + [None] if self.shifted_prompt_logprobs else out

    def _trickle(self, h, every: float, limit: float | None) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(1 << 20))
        h.end_headers()
        h.wfile.flush()
        end = None if limit is None else time.monotonic() + limit
        try:
            while not self._stop.wait(every) and (end is None or time.monotonic() < end):
                h.wfile.write(b" ")
                h.wfile.flush()
        except OSError:
            pass  # the client went

    @staticmethod
    def _send(h, status: int, answer) -> None:
        FakeVLLM._send_raw(h, status, json.dumps(answer).encode(), "application/json")

    @staticmethod
    def _send_raw(h, status: int, data: bytes, kind: str) -> None:
        try:
            h.send_response(status)
            h.send_header("Content-Type", kind)
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data)
            h.wfile.flush()
        except OSError:
            pass
