"""An OpenAI-compatible endpoint over the policy: what agent code talks to (gspo.agents.runner).

    endpoint = Endpoint(sample, tokenizer, "gspo-policy", limits).start()   # 127.0.0.1, a free port
    url = endpoint.open_episode(7)       # http://127.0.0.1:PORT/e/7/v1: an OpenAI client's base_url
    ...                                  # the agent's calls, with `Authorization: Bearer {endpoint.secret}`
    calls = endpoint.close_episode(7)    # every call sampled, token for token; later calls get an error
    endpoint.stop()

Who may call. Every request must carry the endpoint's secret (random, per endpoint) as the
OpenAI bearer key (`api_key=endpoint.secret`); anything else gets 401 before its body is read
further, and nothing of it is recorded or sampled (`refused` counts them). The port is
reachable by every local user; the secret is held in the trainer's process and handed only to
the run's own clients.

Routes, under each episode's base URL: `GET /models`, `POST /chat/completions`, `POST /completions`.
The server binds to loopback only and lives while a rollout runs. Requests from every episode
are batched: once a request waits, the batch grows until every open episode has a call waiting
or none arrived for `window` seconds; then all pending ones are sampled in one call of
`sample(prompts, max_tokens, rows)` on the endpoint's one sampling thread (so the sampler is
never called from two threads).

Tokens, never text. A chat request's messages are rendered by the chat template into prompt
ids, except where they extend an earlier call of the episode (its parent): that call's
messages, then the assistant message it returned, then new ones (tool results, a user turn).
Then the prompt is the parent's prompt ids, the ids it sampled, and the new messages' tokens
rendered by difference (gspo.tasks.env.observation_text): the sampled tokens are never
re-tokenised. A completions request extends a call when its prompt ids (text, or a list of
ids) start with that call's prompt and completion ids. Of several such calls the parent is
the one with the longest history (the latest of equals).

Call graphs. Calls are recorded in the order they began. Each belongs to a sequence (a row to
train): a call whose parent is the latest call of the parent's sequence joins it
(`Call.extends`); any other call starts a sequence of its own: one with no parent (an edited,
truncated or new history), and one whose parent already has a continuation (concurrent
continuations of one history, `asyncio.gather`, forks, a retry). So each sequence's calls
continue each other, and every sampled token sits in a row exactly in the context it was
sampled in. The turn limit (`max_calls`) counts the calls begun, under the lock, in flight
ones included. A call whose caller gave up before it was answered (`abandon`) is not recorded.

Checked per request: token ids (`0 <= id < vocab_size`), and the context: prompt plus at least
one new token within `max_context` (the model's length; vLLM's max_model_len), the completion
cut to fit. A bad request gets an OpenAI-style 400 for itself alone; the other calls go on.

Sampling: the run's temperature, top-p and top-k; a request's `max_tokens` (or
`max_completion_tokens`) only lowers the run's --max-new-tokens. `n` must be 1. With `stream`
true the call is sampled whole, as any other, and sent as server-sent events (stream_events):
one chunk with the whole message, one with the finish reason, a usage chunk when
`stream_options.include_usage` asks, then `[DONE]`.
Responses carry the usual fields plus vLLM's token fields (`prompt_token_ids`, and per choice
`token_ids`), and `logprobs` when asked. Errors are OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`.

Left out: a request's own `temperature`, `top_p`, `seed` and `stop` (the run's sampling is
what is trained on); `n` > 1 (the group's completions are episodes of their own).
"""

from __future__ import annotations

import hmac
import json
import secrets
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
    """One request of an episode, as sampled (module docstring, Call graphs)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    truncated: bool  # stopped by its max_tokens before a stop token
    extends: bool  # continues its sequence: the previous call's prompt + completion + new tokens
    messages: list | None = None  # chat: the request's messages and the message returned
    reply: dict | None = None
    index: int = 0  # its place among the episode's calls, in the order they began
    parent: int | None = None  # the index of the call whose history it extends (None: none)
    sequence: int = 0  # the episode's sequence (row) it belongs to
    done: bool = False  # sampled and answered (an abandoned or late call never is)


@dataclass
class _Episode:
    calls: list[Call] = field(default_factory=list)  # every call begun, in order
    open: bool = True
    latest: dict = field(default_factory=dict)  # sequence -> its latest call
    first: dict = field(default_factory=dict)  # sequence -> its first call


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
            try:
                self.notify()
            except RuntimeError:  # the caller's event loop is closed: it gave up waiting
                pass


@dataclass(frozen=True)
class Limits:
    """max_new_tokens: the run's cap per call; stop_token_ids: what ends a completion; max_calls:
    calls per episode at most (0: none); max_episode_tokens: the token budget of each of the
    episode's sequences after its first prompt (0: none); window: seconds a request waits for others to batch with;
    episode_timeout: the agent's seconds for an episode (0: none; gspo.agents.runner);
    vocab_size: a prompt's token ids are below it (0: unchecked); max_context: a prompt and its
    completion at most, in tokens (0: no limit)."""

    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    max_calls: int = 0
    max_episode_tokens: int = 0
    window: float = 0.05
    episode_timeout: float = 0.0
    vocab_size: int = 0
    max_context: int = 0


class Endpoint:
    """The server (module docstring). `sample(prompts, max_tokens, rows)` -> per prompt
    (completion ids, log-probs, truncated), `max_tokens` the batch's largest cap, `rows` the
    episodes' keys; `limits` (Limits) the run's. `secret`: the bearer key every request must
    carry (None: a random one, `self.secret`)."""

    def __init__(self, sample, tokenizer, model_name: str, limits: Limits, secret: str | None = None):
        self.sample, self.tokenizer, self.model_name = sample, tokenizer, model_name
        self.limits = limits
        self.max_new_tokens, self.stop_token_ids = limits.max_new_tokens, tuple(limits.stop_token_ids)
        self.max_calls, self.max_episode_tokens = limits.max_calls, limits.max_episode_tokens
        self.window = limits.window
        self.secret = secret or secrets.token_urlsafe(32)
        self.episodes: dict[int, _Episode] = {}
        self.late_calls: list[str] = []  # one line per call after its episode ended
        self.refused = 0  # requests without the secret (401)
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
        """The episode's calls that were sampled and answered, in the order they began; any call
        from now on is refused (409)."""
        with self._lock:
            ep = self.episodes[key]
            ep.open = False
            return [c for c in ep.calls if c.done]

    # -- requests ---------------------------------------------------------------------------
    def handle(self, method: str, path: str, body: dict | None, key: str | None = None) -> dict:
        """The response body of one request (raises RequestError); blocks while it is sampled.
        `key`: the request's bearer key."""
        pending = self.begin(method, path, body, key)
        if isinstance(pending, dict):
            return pending
        pending.done.wait()
        return self.finish(pending)

    async def handle_async(self, method: str, path: str, body: dict | None, key: str | None = None) -> dict:
        """handle() for a caller in an event loop (InProcess): it waits without holding a thread;
        a caller that gives up (cancelled) abandons its call."""
        import asyncio

        pending = self.begin(method, path, body, key)
        if isinstance(pending, dict):
            return pending
        loop = asyncio.get_running_loop()
        woken = loop.create_future()
        pending.notify = lambda: loop.call_soon_threadsafe(lambda: woken.done() or woken.set_result(None))
        if pending.done.is_set():  # sampled before the wake-up was in place
            pending.notify()
        try:
            await woken
        except asyncio.CancelledError:
            self.abandon(pending)
            raise
        return self.finish(pending)

    def authorized(self, key: str | None) -> bool:
        """Whether `key` is the endpoint's secret (compared in constant time); counts refusals."""
        if key is not None and hmac.compare_digest(key.encode(), self.secret.encode()):
            return True
        with self._lock:
            self.refused += 1
        return False

    def begin(self, method: str, path: str, body: dict | None, key: str | None = None):
        """A request checked, its prompt rendered and queued for sampling (a _Pending), or the
        response of one that needs no sampling (a dict); raises RequestError. `key`: its bearer key."""
        if not self.authorized(key):
            raise _unauthorized()
        parts = path.rstrip("/").split("/")  # '', 'e', KEY, 'v1', route...
        if len(parts) < 5 or parts[1] != "e" or parts[3] != "v1":
            raise RequestError(404, f"no route {path}: use the episode's base URL, /e/<episode>/v1", "not_found")
        route = "/".join(parts[4:])
        if method == "GET" and route == "models":
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "gspo"}]}
        if method != "POST" or route not in ("chat/completions", "completions"):
            raise RequestError(404, f"no route {method} /v1/{route} (routes: GET /v1/models, POST "
                                    "/v1/chat/completions, POST /v1/completions)", "not_found")
        key, ep = parts[2], self._episode(parts[2], route)
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object", "invalid_body")
        if body.get("stream") is not None and type(body.get("stream")) is not bool:
            raise RequestError(400, f"stream: expected true or false (got {body.get('stream')!r})", "invalid_value",
                               "stream")
        if body.get("n") is not None and (type(body.get("n")) is not int or body.get("n") != 1):
            raise RequestError(400, f"n: must be 1 (got {body.get('n')!r}); the group's completions are episodes of "
                                    "their own", "unsupported", "n")
        asked = self._asked(body)
        with self._lock:  # what the episode has answered so far: the calls a new one may extend
            answered = [c for c in ep.calls if c.done]
        prompt, parent, messages, tools = (self._chat_prompt(answered, body) if route == "chat/completions"
                                           else self._text_prompt(answered, body))
        self._check_ids(prompt)
        with self._lock:  # its place in the episode's call graph, the turn limit and the budget: one decision
            if not ep.open:
                self.late_calls.append(f"episode {key}: POST /v1/{route} after its episode ended (refused)")
                raise RequestError(409, f"episode {key} has ended", "episode_ended")
            if self.max_calls and len(ep.calls) >= self.max_calls:  # begun: in flight or answered
                raise RequestError(400, f"this episode made its {self.max_calls} calls (--max-turns)", "turn_limit")
            joins = parent is not None and ep.latest.get(parent.sequence) is parent
            sequence = parent.sequence if joins else len(ep.first)
            cap = self._cap(asked, prompt, ep.first[sequence].prompt_ids if joins else prompt)
            call = Call(prompt, [], [], False, joins, messages, index=len(ep.calls),
                        parent=parent.index if parent is not None else None, sequence=sequence)
            ep.calls.append(call)
            ep.latest[sequence] = call
            ep.first.setdefault(sequence, call)
            pending = _Pending(prompt, cap, int(key), context=(key, route, ep, call, tools, body))
            self._queue.append(pending)
            self._lock.notify_all()
        return pending

    def finish(self, pending: _Pending) -> dict:
        """The response of a sampled request, its call recorded in its episode."""
        key, route, ep, call, tools, body = pending.context
        if pending.error is not None:
            raise RequestError(500, f"sampling failed: {type(pending.error).__name__}: {pending.error}", "sampling")
        call.completion_ids, call.logprobs, call.truncated = pending.result
        if route == "chat/completions":
            call.reply = self._message(call.completion_ids, tools)
        with self._lock:
            if not ep.open:  # the episode ended while this call was sampled
                self.late_calls.append(f"episode {key}: a call finished after its episode ended (not recorded)")
                raise RequestError(409, f"episode {key} has ended", "episode_ended")
            call.done = True
        if route == "chat/completions":
            return self._chat_response(call, body)
        return self._text_response(call, body)

    def abandon(self, pending: _Pending) -> None:
        """A call whose caller gave up before its answer: out of the queue if still there, never
        recorded; its sequence's latest call is its parent again (a retry of it joins the sequence)."""
        _, _, ep, call, _, _ = pending.context
        with self._lock:
            if pending in self._queue:
                self._queue.remove(pending)
            if ep.latest.get(call.sequence) is call:
                parent = ep.calls[call.parent] if call.parent is not None else None
                if parent is not None and parent.sequence == call.sequence:
                    ep.latest[call.sequence] = parent
                else:
                    del ep.latest[call.sequence]

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

    def _chat_prompt(self, answered: list[Call], body: dict):
        """(prompt ids, parent call or None, messages, tool schemas) of a chat request."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m
                                                                      for m in messages):
            raise RequestError(400, "messages: expected a non-empty list of {'role': ..., 'content': ...}",
                               "invalid_messages", "messages")
        schemas = body.get("tools") or None  # OpenAI's {"type": "function", "function": {...}}: what templates take
        parent = _chat_parent(answered, messages)
        if parent is not None:
            k = len(parent.messages)
            stopped = (self.tokenizer.decode(parent.completion_ids[-1:])
                       if parent.completion_ids and parent.completion_ids[-1] in self.stop_token_ids else None)
            try:
                tail = observation_text(self.tokenizer, [_plain(m) for m in messages[k + 1:]], schemas, stopped)
            except Exception as e:
                raise RequestError(400, f"messages: the chat template cannot render them: {type(e).__name__}: "
                                        f"{e}", "invalid_messages", "messages") from None
            ids = self.tokenizer(tail, add_special_tokens=False)["input_ids"]
            return parent.prompt_ids + parent.completion_ids + ids, parent, messages, schemas
        try:
            text = self.tokenizer.apply_chat_template([_plain(m) for m in messages], tools=schemas,
                                                      add_generation_prompt=True, tokenize=False)
        except Exception as e:
            raise RequestError(400, f"messages: the chat template cannot render them: {type(e).__name__}: {e}",
                               "invalid_messages", "messages") from None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"], None, messages, schemas

    def _text_prompt(self, answered: list[Call], body: dict):
        """(prompt ids, parent call or None, None, None) of a completions request."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            ids = list(prompt)
        else:
            raise RequestError(400, "prompt: expected a non-empty string or list of token ids", "invalid_prompt",
                               "prompt")
        parent = None  # the answered call with the longest history that the prompt extends (the latest of equals)
        for c in answered:
            n = len(c.prompt_ids) + len(c.completion_ids)
            if len(ids) > n and ids[:len(c.prompt_ids)] == c.prompt_ids and ids[len(c.prompt_ids):n] == \
                    c.completion_ids and (parent is None or n >= len(parent.prompt_ids) + len(parent.completion_ids)):
                parent = c
        return ids, parent, None, None

    def _check_ids(self, prompt: list[int]) -> None:
        """A prompt the model can read: its ids in the vocabulary, and room for one new token."""
        vocab, context = self.limits.vocab_size, self.limits.max_context
        if vocab and any(t < 0 or t >= vocab for t in prompt):
            bad = next(t for t in prompt if t < 0 or t >= vocab)
            raise RequestError(400, f"prompt: token id {bad} is not in the model's vocabulary (0 <= id < {vocab})",
                               "invalid_token_id", "prompt")
        if context and len(prompt) >= context:
            raise RequestError(400, f"this model's maximum context length is {context} tokens; the prompt has "
                                    f"{len(prompt)} (room for no completion)", "context_length_exceeded", "messages")

    def _asked(self, body: dict) -> int | None:
        """The request's own cap (max_completion_tokens, else max_tokens), checked; None: none."""
        for name in ("max_completion_tokens", "max_tokens"):
            asked = body.get(name)
            if asked is None:
                continue
            if type(asked) is not int or asked < 1:
                raise RequestError(400, f"{name}: expected a positive integer (got {asked!r})", "invalid_value", name)
            return asked
        return None

    def _cap(self, asked: int | None, prompt: list[int], first_prompt: list[int]) -> int:
        """The call's completion tokens at most: the run's cap, lowered by the request's, the
        sequence's budget after its first prompt (`first_prompt`) and the model's context."""
        cap = min(self.max_new_tokens, asked or self.max_new_tokens)
        if self.max_episode_tokens:  # the sequence's tokens after its first prompt
            left = self.max_episode_tokens - (len(prompt) - len(first_prompt))
            if left < 1:
                raise RequestError(400, f"this sequence of the episode used its {self.max_episode_tokens} tokens "
                                   "(--max-episode-tokens)", "episode_budget")
            cap = min(cap, left)
        if self.limits.max_context:
            cap = min(cap, self.limits.max_context - len(prompt))
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


def bearer(header: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header (None: no such header)."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


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
                out = await endpoint.handle_async(request.method, request.url.path, body,
                                                  bearer(request.headers.get("authorization")))
                if _streamed(body):
                    return httpx.Response(200, content=stream_events(out, body),
                                          headers={"Content-Type": "text/event-stream"})
                return httpx.Response(200, json=out)
            except RequestError as e:
                return httpx.Response(e.status, json=e.body())
            except Exception as e:  # never a hung client: an OpenAI-shaped 500
                return httpx.Response(500, json=RequestError(500, f"{type(e).__name__}: {e}", "internal").body())

    return InProcess()


def _unauthorized() -> RequestError:
    return RequestError(401, "no valid API key: this endpoint serves the training run's own agents, which get its "
                             "key through the client they are handed", "invalid_api_key")


IDLE_SECONDS = 60.0  # a connection's reads and writes wait at most this long
MAX_CONNECTIONS = 2048  # connections served at once (a thread each); more are closed at once


class _Server(ThreadingHTTPServer):
    """The loopback server: a thread per connection, at most MAX_CONNECTIONS at once (a local
    process that opens connections and sends nothing holds no more than that, each at most
    IDLE_SECONDS)."""

    # a step's episodes connect at once: http.server's backlog of 5 refused most of 64 (APIConnectionError)
    request_queue_size = 4096

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.live = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request, client_address):
        if not self.live.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.live.release()


def _chat_parent(answered: list[Call], messages: list) -> Call | None:
    """The answered chat call whose history `messages` extend: its messages, the reply it
    returned, then at least one new message; the longest such history, the latest of equals."""
    parent = None
    for c in answered:
        if c.messages is None or c.reply is None:
            continue
        k = len(c.messages)
        if (len(messages) > k + 1 and (parent is None or k >= len(parent.messages))
                and _same(messages[:k], c.messages) and _same([messages[k]], [c.reply])):
            parent = c
    return parent


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
        timeout = IDLE_SECONDS  # a connection that sends nothing this long is closed (its thread with it)

        def _reply(self, status: int, body: dict, events: bytes | None = None) -> None:
            data = json.dumps(body).encode() if events is None else events
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if events is None else "text/event-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _serve(self, method: str) -> None:
            body, key = None, bearer(self.headers.get("Authorization"))
            if method == "POST":
                if not endpoint.authorized(key):  # refused before its body is read into memory or parsed
                    self.close_connection = True
                    return self._reply(401, _unauthorized().body())
                try:
                    n = int(self.headers.get("Content-Length") or 0)
                    body = json.loads(self.rfile.read(n) if n > 0 else b"null")
                except ValueError:
                    self.close_connection = True
                    return self._reply(400, RequestError(400, "the request body is not JSON (with a valid "
                                                              "Content-Length)", "invalid_json").body())
            try:
                out = endpoint.handle(method, self.path, body, key)
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
