"""An OpenAI-compatible endpoint over the policy: what agent code talks to (gspo.sampling.agents).

    endpoint = Endpoint(sample, tokenizer, "gspo-policy").start()     # 127.0.0.1, a free port
    url = endpoint.open_episode(7)       # http://127.0.0.1:PORT/e/7/v1: an OpenAI client's base_url
    ...                                  # the agent's calls: POST {url}/chat/completions, {url}/completions
    calls = endpoint.close_episode(7)    # every call, token for token; later calls get an error
    endpoint.stop()

Routes, under each episode's base URL: `GET /models`, `POST /chat/completions`, `POST /completions`.
The server binds to loopback only and lives while a rollout runs. Requests from every episode
are batched: once a request waits, the batch grows until every open episode has a call waiting
or none arrived for `window` seconds; then all pending ones are sampled in one call of
`sample(prompts, max_tokens, rows)` on the endpoint's one sampling thread (so the sampler is
never called from two threads).

Tokens, never text. A chat request's messages are rendered by the chat template into prompt
ids, except where they extend the episode's last call: its messages, then the assistant message
it returned, then new ones (tool results, a user turn). Then the prompt is that call's prompt
ids, the ids it sampled, and the new messages' tokens rendered by difference
(gspo.tasks.env.observation_text): the sampled tokens are never re-tokenised. Such a call
continues the episode's sequence (`Call.extends`); any other history (edited, truncated,
reordered) starts a new one. A completions request extends when its prompt ids (text, or a
list of ids) start with the last call's prompt and completion ids.

Sampling: the run's temperature, top-p and top-k; a request's `max_tokens` (or
`max_completion_tokens`) only lowers the run's --max-new-tokens. `n` must be 1. With `stream`
true the call is sampled whole, as any other, and sent as server-sent events (stream_events):
one chunk with the whole message, one with the finish reason, a usage chunk when
`stream_options.include_usage` asks, then `[DONE]`.
Responses carry the usual fields plus vLLM's token fields (`prompt_token_ids`, and per choice
`token_ids`), and `logprobs` when asked. Errors are OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gspo.tasks.env import TOOL_CALL, observation_text


class RequestError(Exception):
    """A request the endpoint refuses: its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass
class Call:
    """One request of an episode, as sampled."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    truncated: bool  # stopped by its max_tokens before a stop token
    extends: bool  # its prompt is the previous call's prompt + completion + new tokens
    messages: list | None = None  # chat: the request's messages and the message returned
    reply: dict | None = None


@dataclass
class _Episode:
    calls: list[Call] = field(default_factory=list)
    open: bool = True


@dataclass
class _Pending:
    prompt: list[int]
    max_tokens: int
    row: int
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple | None = None
    error: BaseException | None = None
    context: tuple = ()  # what finish() needs: key, route, episode, extends, messages, tools, body
    notify: object = None  # called from the sampling thread once done (an asyncio caller's wake-up)

    def finished(self) -> None:
        self.done.set()
        if self.notify is not None:
            self.notify()


@dataclass(frozen=True)
class Limits:
    """max_new_tokens: the run's cap per call; stop_token_ids: what ends a completion; max_calls:
    calls per episode at most (0: none); max_episode_tokens: the token budget of each of the
    episode's sequences after its first prompt (0: none); window: seconds a request waits for others to batch with;
    episode_timeout: the agent's seconds for an episode (0: none; gspo.sampling.agents)."""

    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    max_calls: int = 0
    max_episode_tokens: int = 0
    window: float = 0.05
    episode_timeout: float = 0.0


class Endpoint:
    """The server (module docstring). `sample(prompts, max_tokens, rows)` -> per prompt
    (completion ids, log-probs, truncated), `max_tokens` the batch's largest cap, `rows` the
    episodes' keys; `limits` (Limits) the run's."""

    def __init__(self, sample, tokenizer, model_name: str, limits: Limits):
        self.sample, self.tokenizer, self.model_name = sample, tokenizer, model_name
        self.max_new_tokens, self.stop_token_ids = limits.max_new_tokens, tuple(limits.stop_token_ids)
        self.max_calls, self.max_episode_tokens = limits.max_calls, limits.max_episode_tokens
        self.window = limits.window
        self.episodes: dict[int, _Episode] = {}
        self.late_calls: list[str] = []  # one line per call after its episode ended
        self._lock = threading.Condition()
        self._queue: list[_Pending] = []
        self._server = None
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self.batches: list[int] = []  # requests per sample() call

    # -- life -------------------------------------------------------------------------------
    def start(self) -> Endpoint:
        self._server = _Server(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._threads = [threading.Thread(target=self._server.serve_forever, name="gspo-endpoint", daemon=True),
                         threading.Thread(target=self._batch_loop, name="gspo-endpoint-batch", daemon=True)]
        for t in self._threads:
            t.start()
        return self

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for t in self._threads:
            t.join(timeout=5)

    def open_episode(self, key: int) -> str:
        with self._lock:
            self.episodes[key] = _Episode()
        return f"http://127.0.0.1:{self.port}/e/{key}/v1"

    def close_episode(self, key: int) -> list[Call]:
        with self._lock:
            ep = self.episodes[key]
            ep.open = False
            return list(ep.calls)

    # -- requests ---------------------------------------------------------------------------
    def handle(self, method: str, path: str, body: dict | None) -> dict:
        """The response body of one request (raises RequestError); blocks while it is sampled."""
        pending = self.begin(method, path, body)
        if isinstance(pending, dict):
            return pending
        pending.done.wait()
        return self.finish(pending)

    async def handle_async(self, method: str, path: str, body: dict | None) -> dict:
        """handle() for a caller in an event loop (InProcess): it waits without holding a thread."""
        import asyncio

        pending = self.begin(method, path, body)
        if isinstance(pending, dict):
            return pending
        loop = asyncio.get_running_loop()
        woken = loop.create_future()
        pending.notify = lambda: loop.call_soon_threadsafe(lambda: woken.done() or woken.set_result(None))
        if pending.done.is_set():  # sampled before the wake-up was in place
            pending.notify()
        await woken
        return self.finish(pending)

    def begin(self, method: str, path: str, body: dict | None):
        """A request checked, its prompt rendered and queued for sampling (a _Pending), or the
        response of one that needs no sampling (a dict); raises RequestError."""
        parts = path.rstrip("/").split("/")  # '', 'e', KEY, 'v1', route...
        if len(parts) < 5 or parts[1] != "e" or parts[3] != "v1":
            raise RequestError(404, f"no route {path}: use the episode's base URL, /e/<episode>/v1", "not_found")
        key, route = parts[2], "/".join(parts[4:])
        if method == "GET" and route == "models":
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "gspo"}]}
        if method != "POST" or route not in ("chat/completions", "completions"):
            raise RequestError(404, f"no route {method} /v1/{route} (routes: GET /v1/models, POST "
                                    "/v1/chat/completions, POST /v1/completions)", "not_found")
        ep = self._episode(key, route)
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object", "invalid_body")
        if body.get("stream") not in (None, False, True):
            raise RequestError(400, f"stream: expected true or false (got {body.get('stream')!r})", "invalid_value",
                               "stream")
        if body.get("n", 1) not in (1, None):
            raise RequestError(400, f"n: must be 1 (got {body.get('n')!r}); the group's completions are episodes of "
                                    "their own", "unsupported", "n")
        if self.max_calls and len(ep.calls) >= self.max_calls:
            raise RequestError(400, f"this episode made its {self.max_calls} calls (--max-turns)", "turn_limit")
        prompt, extends, messages, tools = (self._chat_prompt(ep, body) if route == "chat/completions"
                                            else self._text_prompt(ep, body))
        cap = self._cap(ep, body, prompt, extends)
        pending = _Pending(prompt, cap, int(key), context=(key, route, ep, extends, messages, tools, body))
        with self._lock:
            self._queue.append(pending)
            self._lock.notify_all()
        return pending

    def finish(self, pending: _Pending) -> dict:
        """The response of a sampled request, its call recorded in its episode."""
        key, route, ep, extends, messages, tools, body = pending.context
        prompt = pending.prompt
        if pending.error is not None:
            raise RequestError(500, f"sampling failed: {type(pending.error).__name__}: {pending.error}", "sampling")
        ids, logps, truncated = pending.result
        call = Call(prompt, ids, logps, truncated, extends)
        with self._lock:
            if not ep.open:  # the episode ended while this call was sampled
                self.late_calls.append(f"episode {key}: a call finished after its episode ended (not recorded)")
                raise RequestError(409, f"episode {key} has ended", "episode_ended")
            ep.calls.append(call)
        if route == "chat/completions":
            call.reply = self._message(ids, tools)
            call.messages = messages
            return self._chat_response(call, body)
        return self._text_response(call, body)

    def _episode(self, key: str, route: str) -> _Episode:
        with self._lock:
            ep = self.episodes.get(int(key)) if key.isdigit() else None
            if ep is None:
                raise RequestError(404, f"no episode {key}", "not_found")
            if not ep.open:
                self.late_calls.append(f"episode {key}: POST /v1/{route} after its episode ended (refused)")
                raise RequestError(409, f"episode {key} has ended: a call after the rollout function returned, "
                                        "failed or ran out of time", "episode_ended")
            return ep

    def _chat_prompt(self, ep: _Episode, body: dict):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m
                                                                      for m in messages):
            raise RequestError(400, "messages: expected a non-empty list of {'role': ..., 'content': ...}",
                               "invalid_messages", "messages")
        schemas = body.get("tools") or None  # OpenAI's {"type": "function", "function": {...}}: what templates take
        last = ep.calls[-1] if ep.calls else None
        if last is not None and last.messages is not None:
            k = len(last.messages)
            if (len(messages) > k + 1 and _same(messages[:k], last.messages)
                    and _same([messages[k]], [last.reply])):
                stopped = (self.tokenizer.decode(last.completion_ids[-1:])
                           if last.completion_ids and last.completion_ids[-1] in self.stop_token_ids else None)
                tail = observation_text(self.tokenizer, [_plain(m) for m in messages[k + 1:]], schemas, stopped)
                ids = self.tokenizer(tail, add_special_tokens=False)["input_ids"]
                return last.prompt_ids + last.completion_ids + ids, True, messages, schemas
        try:
            text = self.tokenizer.apply_chat_template([_plain(m) for m in messages], tools=schemas,
                                                      add_generation_prompt=True, tokenize=False)
        except Exception as e:
            raise RequestError(400, f"messages: the chat template cannot render them: {type(e).__name__}: {e}",
                               "invalid_messages", "messages") from None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"], False, messages, schemas

    def _text_prompt(self, ep: _Episode, body: dict):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            ids = list(prompt)
        else:
            raise RequestError(400, "prompt: expected a string or a list of token ids", "invalid_prompt", "prompt")
        last = ep.calls[-1] if ep.calls else None
        before = last.prompt_ids + last.completion_ids if last is not None else None
        return ids, before is not None and len(ids) > len(before) and ids[:len(before)] == before, None, None

    def _cap(self, ep: _Episode, body: dict, prompt: list[int], extends: bool) -> int:
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        if asked is not None and (type(asked) is not int or asked < 1):
            raise RequestError(400, f"max_tokens: expected a positive integer (got {asked!r})", "invalid_value",
                               "max_tokens")
        cap = min(self.max_new_tokens, asked or self.max_new_tokens)
        if self.max_episode_tokens and ep.calls and extends:  # the sequence's tokens after its first prompt
            first = next(c for c in reversed(ep.calls) if not c.extends)  # an episode's first call extends nothing
            left = self.max_episode_tokens - (len(prompt) - len(first.prompt_ids))
            if left < 1:
                raise RequestError(400, f"this sequence of the episode used its {self.max_episode_tokens} tokens "
                                   "(--max-episode-tokens)", "episode_budget")
            cap = min(cap, left)
        return cap

    def _message(self, ids: list[int], tools) -> dict:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        msg = {"role": "assistant", "content": text}
        if tools:
            calls = []
            for i, raw in enumerate(TOOL_CALL.findall(text)):
                try:
                    call = json.loads(raw)
                    args = call.get("arguments", {})
                    calls.append({"id": f"call_{i}", "type": "function", "function": {
                        "name": str(call["name"]), "arguments": args if isinstance(args, str) else json.dumps(args)}})
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue  # not a call: it stays in the content, as the model wrote it
            if calls:  # OpenAI's shape: the calls apart, the content what is left (a template renders them back)
                msg["tool_calls"] = calls
                msg["content"] = TOOL_CALL.sub("", text).strip()
        return msg

    def _chat_response(self, call: Call, body: dict) -> dict:
        choice = {"index": 0, "message": call.reply, "finish_reason": self._finish(call),
                  "token_ids": call.completion_ids, "logprobs": self._logprobs(call) if body.get("logprobs") else None}
        return {"id": f"chatcmpl-gspo-{id(call):x}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice], "usage": _usage(call),
                "prompt_token_ids": call.prompt_ids}

    def _text_response(self, call: Call, body: dict) -> dict:
        text = self.tokenizer.decode(call.completion_ids, skip_special_tokens=True)
        lp = None
        if body.get("logprobs") is not None:
            toks = [self.tokenizer.decode([t]) for t in call.completion_ids]
            lp = {"tokens": toks, "token_logprobs": call.logprobs, "top_logprobs": None, "text_offset": None}
        choice = {"index": 0, "text": text, "finish_reason": self._finish(call), "logprobs": lp,
                  "token_ids": call.completion_ids}
        return {"id": f"cmpl-gspo-{id(call):x}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice], "usage": _usage(call),
                "prompt_token_ids": call.prompt_ids}

    def _finish(self, call: Call) -> str:
        if call.reply is not None and call.reply.get("tool_calls"):
            return "tool_calls"
        return "length" if call.truncated else "stop"

    def _logprobs(self, call: Call) -> dict:
        out = []
        for t, lp in zip(call.completion_ids, call.logprobs):
            piece = self.tokenizer.decode([t])
            out.append({"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []})
        return {"content": out}

    # -- the sampling thread ----------------------------------------------------------------
    def _gather(self) -> None:
        """Hold the lock until every open episode has a call waiting, or none arrived for `window` s."""
        while not self._stopping:
            waiting = len({p.row for p in self._queue})
            if waiting >= sum(ep.open for ep in self.episodes.values()):
                return
            before = len(self._queue)
            self._lock.wait(self.window)
            if len(self._queue) == before:
                return

    def _batch_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stopping:
                    self._lock.wait()
                if self._stopping:
                    for p in self._queue:
                        p.error = RuntimeError("the endpoint stopped")
                        p.finished()
                    return
            with self._lock:  # the other episodes' calls of this round arrive
                self._gather()
                batch, self._queue = self._queue, []
            self.batches.append(len(batch))
            try:
                results = self.sample([p.prompt for p in batch], max(p.max_tokens for p in batch),
                                      [p.row for p in batch])
                for p, (ids, logps, truncated) in zip(batch, results):
                    n = len(ids)
                    if n > p.max_tokens:  # the batch's cap was higher than this request's
                        ids, logps, truncated = ids[:p.max_tokens], logps[:p.max_tokens], True
                    elif n == p.max_tokens and not (ids and ids[-1] in self.stop_token_ids):
                        truncated = True
                    p.result = (ids, logps, truncated)
            except Exception as e:  # every waiting request gets the error
                for p in batch:
                    p.error = e
            for p in batch:
                p.finished()


def stream_events(response: dict, body: dict) -> bytes:
    """A whole response (chat or text completion) as the server-sent events of a streamed one: a
    chunk with the whole message (or text) and its token ids, a chunk with the finish reason, a
    usage chunk if `stream_options.include_usage`, then `data: [DONE]`."""
    chat = response["object"] == "chat.completion"
    head = {"id": response["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": response["created"], "model": response["model"]}
    (choice,) = response["choices"]
    if chat:
        msg = choice["message"]
        delta = {"role": "assistant", "content": msg["content"]}
        if msg.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(msg["tool_calls"])]
        first = {"index": 0, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}
        last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
    else:
        first = {"index": 0, "text": choice["text"], "logprobs": choice["logprobs"], "finish_reason": None}
        last = {"index": 0, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}
    first["token_ids"] = choice["token_ids"]
    chunks = [{**head, "choices": [first], "prompt_token_ids": response["prompt_token_ids"]},
              {**head, "choices": [last]}]
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({**head, "choices": [], "usage": response["usage"]})
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _streamed(body) -> bool:
    return isinstance(body, dict) and body.get("stream") is True


def in_process(endpoint: Endpoint, httpx):
    """An httpx transport that hands an async client's requests straight to `endpoint`
    (handle_async): the same routes, records and errors as over the socket, without the socket,
    the HTTP parsing or a server thread per request. gspo's own OpenAI clients use it; the
    loopback server still answers any other client of the episode's URL. `httpx`: the module of
    the client's (openai 3 uses `httpx2`, earlier releases `httpx`)."""

    class InProcess(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            body = None
            if request.method == "POST":
                try:
                    body = json.loads(await request.aread() or b"null")
                except ValueError:
                    return httpx.Response(400, json=RequestError(400, "the request body is not JSON",
                                                                 "invalid_json").body())
            try:
                out = await endpoint.handle_async(request.method, request.url.path, body)
                if _streamed(body):
                    return httpx.Response(200, content=stream_events(out, body),
                                          headers={"Content-Type": "text/event-stream"})
                return httpx.Response(200, json=out)
            except RequestError as e:
                return httpx.Response(e.status, json=e.body())
            except Exception as e:  # never a hung client: an OpenAI-shaped 500
                return httpx.Response(500, json=RequestError(500, f"{type(e).__name__}: {e}", "internal").body())

    return InProcess()


class _Server(ThreadingHTTPServer):
    # a step's episodes connect at once: http.server's backlog of 5 refused most of 64 (APIConnectionError)
    request_queue_size = 4096


def _plain(m: dict) -> dict:
    """A message as chat templates take it: text parts joined, None content as ''."""
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    out = {k: v for k, v in m.items() if v is not None}
    out["content"] = content if content is not None else ""
    if out.get("tool_calls"):  # templates take the arguments as an object
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _args(c["function"].get("arguments"))}}
                             for c in out["tool_calls"]]
    return out


def _args(a):
    if isinstance(a, str):
        try:
            return json.loads(a)
        except ValueError:
            return a
    return a


def _same(a: list, b: list) -> bool:
    """The same messages: role, content and tool calls (name and arguments)."""
    def key(m):
        p = _plain(m)
        calls = [(c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                 for c in p.get("tool_calls") or []]
        return p["role"], p["content"], calls
    return len(a) == len(b) and all(key(x) == key(y) for x, y in zip(a, b))


def _usage(call: Call) -> dict:
    p, c = len(call.prompt_ids), len(call.completion_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _handler(endpoint: Endpoint):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _reply(self, status: int, body: dict, events: bytes | None = None) -> None:
            data = json.dumps(body).encode() if events is None else events
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if events is None else "text/event-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _serve(self, method: str) -> None:
            body = None
            if method == "POST":
                n = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(n) or b"null")
                except ValueError:
                    return self._reply(400, RequestError(400, "the request body is not JSON", "invalid_json").body())
            try:
                out = endpoint.handle(method, self.path, body)
                self._reply(200, out, stream_events(out, body) if _streamed(body) else None)
            except RequestError as e:
                self._reply(e.status, e.body())
            except Exception as e:  # never a hung client: an OpenAI-shaped 500
                self._reply(500, RequestError(500, f"{type(e).__name__}: {e}", "internal").body())

        def do_GET(self):  # noqa: N802 (http.server's names)
            self._serve("GET")

        def do_POST(self):  # noqa: N802
            self._serve("POST")

        def log_message(self, *args):  # no access log on stderr
            pass

    return Handler
