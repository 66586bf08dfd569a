"""A served teacher for on-policy distillation: a frozen model behind vLLM's OpenAI-compatible server
scores the student's own tokens in the student's context, log π_teacher(y_t | x, y_<t).

    teacher = ServedTeacher("http://10.0.0.7:8000")   # or .../v1; model=None: the server's only model
    teacher.check(tokenizer)                          # at start: it answers, and its vocabulary is the student's
    lp = teacher.logprobs(sequences, starts)          # lp[i][k] = log p(seq[s + k] | seq[:s + k]), s = starts[i]

Each sequence is one `/v1/completions` request, up to `concurrency` at once, each within `timeout`
seconds; anything but a whole, aligned answer is a TeacherError (one line naming the server, its
model and what happened): a distillation step never takes a teacher's log-prob it cannot vouch for.

What vLLM 0.32 does (read in its source; tests/test_vllm_server.py measures it on a real server):

- **The request**: `{"model", "prompt": [token ids], "max_tokens": 1, "prompt_logprobs": 0,
  "temperature": 0}`. A list of ints is taken as the prompt's token ids as they are (not
  re-tokenized, no BOS added); the server refuses an id outside its vocabulary. `max_tokens: 0`
  is refused ("max_tokens must be at least 1") unless `echo` is set, so one token is generated
  and thrown away. `prompt_logprobs` with `stream: true` is refused.
- **The answer**: `choices[0].prompt_logprobs`, one entry per prompt token, the first null; entry j
  a dict `{"<id>": {"logprob", "rank", "decoded_token"}}` holding prompt[j]'s (and, for
  prompt_logprobs k > 0, the k most likely). A log-prob of -inf is sent as -9999.0.
- **Raw**: prompt log-probs are log_softmax(logits) in float32 at temperature 1, before
  temperature, penalties or any logits processor, whatever the request asks ("prompt tokens skip
  sampling processors"; the gpu and cpu model runners alike), in the server's logprobs modes
  raw_logprobs (the default) and processed_logprobs (what gspo's rollout servers use). A server
  started with `--logprobs-mode raw_logits` or `processed_logits` sends logits there instead: a
  value above 0 is refused here. The request's temperature only shapes the token thrown away
  (measured: the same prompt log-probs at temperature 0, 0.3 and 1.7; within 5e-5 of a float32
  forward's log_softmax on the CPU build).
- **No prefix cache**: a request with prompt_logprobs does not read the prefix cache
  (SamplingParams.skip_reading_prefix_cache), so every sequence is a whole prefill; a server
  with `--kv-sharing-fast-prefill` refuses prompt_logprobs.
- **Lengths**: a prompt of L tokens needs max_model_len >= L + 1 (the prompt and the token
  generated: a prompt of exactly max_model_len is refused, 400 "max_tokens must be at least 1, got
  0"). `/v1/models` names max_model_len, and a longer sequence is refused here before anything is
  sent.
- **Tokenizer routes**: `POST /tokenize {"model", "prompt", "add_special_tokens",
  "return_token_strs"}` -> `{"count", "max_model_len", "tokens", "token_strs"}`; `POST /detokenize
  {"model", "tokens"}` -> `{"prompt"}` (ids are not checked there). No route says the vocabulary's
  size (/v1/models, /tokenize, the optional /tokenizer_info): `check` decodes ids spread over the
  student's vocabulary, its last one included, and names the student's size.

Left out: cross-tokenizer distillation (the teacher must share the student's vocabulary); a teacher
gspo starts itself; retries (a failed request fails the step, and --resume continues the run).
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor

from gspo.io.http import BadAddress, HTTPFailed, exchange, server_base
from gspo.sampling.vllm_server import KEY_VARIABLE, LOGP_SLACK, ServerError, _reason

# the tokenizer probe: words, digits, punctuation, whitespace and unicode (accents, CJK, emoji, math)
PROBE = ("The quick brown fox jumps over the lazy dog; 12 + 30 = 42, and 3.14159 is near pi. "
         "def f(x): return x ** 2  # squares\n\tTabs, 'quotes', \"double\" and (brackets) [0, 1] {a: b}! "
         "Naïve café, Ærøskøbing, straße, Ωmega; 東京で寿司を食べた。 Привет, мир! 🙂🚀 ∑ x_i ≤ ∞ — done.\n")
SPREAD = 8  # ids decoded on both sides, spread over the student's vocabulary (its last one included)


class TeacherError(ServerError):
    """A teacher server that is down, slow or wrong: one line naming it, its model and what happened."""


class ServedTeacher:
    """A frozen teacher behind a vLLM server: log-probs of given token sequences, one request each.

    url: the server's base as users type it (http://host:8000, or http://host:8000/v1). model: the id
    /v1/models names (None: the server's only model). timeout: seconds for each request. key: the
    server's API key (None: VLLM_API_KEY). Nothing is asked of the server until `check` or `logprobs`."""

    def __init__(self, url: str, *, model: str | None = None, timeout: float = 120.0, concurrency: int = 8,
                 key: str | None = None):
        self.url = base_url(url)
        self.model = model
        self.timeout = float(timeout)
        self.concurrency = max(1, int(concurrency))
        self.key = key if key is not None else os.environ.get(KEY_VARIABLE) or None
        self.max_model_len = 0  # as /v1/models says (0: unknown)
        self._asked = False  # /v1/models asked

    def __repr__(self) -> str:
        return f"ServedTeacher({self.url!r}, model={self.model!r})"

    def check(self, tokenizer) -> None:
        """At start: the server answers, serves the model, scores a prompt, and tokenizes as the student's
        `tokenizer` does (the probe's ids and strings, and ids spread over the vocabulary decoded alike)."""
        self._served()
        ids = list(tokenizer.encode(PROBE, add_special_tokens=False))
        answer = self._call("/tokenize", {"model": self.model, "prompt": PROBE, "add_special_tokens": False,
                                          "return_token_strs": True}, "/tokenize")
        theirs = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(theirs, list):
            raise self._error(f"/tokenize answered without tokens ({_cut(answer)})")
        if theirs != ids:
            raise self._error(f"its tokenizer is not the student's: {_first_difference(tokenizer, ids, answer)}")
        n = len(tokenizer)
        for t in sorted({round(i * (n - 1) / (SPREAD - 1)) for i in range(SPREAD)}):
            text = (self._call("/detokenize", {"model": self.model, "tokens": [t]}, "/detokenize") or {}).get("prompt")
            if text != tokenizer.decode([t]):
                raise self._error(f"its tokenizer is not the student's: token id {t} decodes to {text!r} there and "
                                  f"to {tokenizer.decode([t])!r} in the student's ({n} tokens)")
        fits = self.max_model_len - 1 if self.max_model_len else len(ids)
        if min(len(ids), fits) >= 2:  # a prompt scored: the route answers, with log-probs
            self.logprobs([ids[:fits]], [1])

    def logprobs(self, sequences: list[list[int]], starts: list[int]) -> list[list[float]]:
        """For each token-id sequence, log p(seq[j] | seq[:j]) under the teacher at temperature 1, for j in
        range(starts[i], len(seq)): a list of len(seq) - starts[i] floats. starts[i] >= 1 (the first token
        has no context). Requests run `concurrency` at once, each within the deadline."""
        if len(sequences) != len(starts):
            raise ValueError(f"logprobs: {len(sequences)} sequences and {len(starts)} starts")
        for seq, s in zip(sequences, starts):
            if not 1 <= s <= len(seq):
                raise ValueError(f"logprobs: a start of {s} in a sequence of {len(seq)} tokens (1 <= start <= length)")
        self._served()
        longest = max((len(seq) for seq in sequences), default=0)
        if self.max_model_len and longest + 1 > self.max_model_len:
            raise self._error(f"a sequence of {longest} tokens and the token vLLM generates do not fit its "
                              f"max_model_len {self.max_model_len}; start it with --max-model-len {longest + 1} "
                              "or more")
        todo = [i for i, (seq, s) in enumerate(zip(sequences, starts)) if s < len(seq)]
        out = [[] for _ in sequences]
        pool = ThreadPoolExecutor(max_workers=min(self.concurrency, max(1, len(todo))),
                                  thread_name_prefix="gspo-teacher")
        try:
            for i, lp in zip(todo, pool.map(lambda i: self._score(sequences[i], starts[i]), todo)):
                out[i] = lp
        finally:  # a failure: the requests not begun are dropped; those under way end by their deadline
            pool.shutdown(wait=False, cancel_futures=True)
        return out

    # --- the pieces ---

    def _score(self, seq: list[int], start: int) -> list[float]:
        """One sequence's request: its tokens' log-probs from `start`, each checked (there, aligned, <= 0)."""
        body = {"model": self.model, "prompt": [int(t) for t in seq], "max_tokens": 1, "prompt_logprobs": 0,
                "temperature": 0, "logprobs": None}
        answer = self._call("/v1/completions", body, f"the prompt log-probs of {len(seq)} tokens")
        choices = answer.get("choices") if isinstance(answer, dict) else None
        entries = choices[0].get("prompt_logprobs") if choices and isinstance(choices[0], dict) else None
        if not isinstance(entries, list) or len(entries) != len(seq):
            got = "none" if entries is None else f"{len(entries)} entries" if isinstance(entries, list) else "garbage"
            raise self._error(f"asked for the prompt log-probs of {len(seq)} tokens, got {got} (a server that does "
                              "not return vLLM's prompt_logprobs)")
        lp = []
        for j in range(start, len(seq)):
            entry = entries[j].get(str(seq[j])) if isinstance(entries[j], dict) else None
            value = entry.get("logprob") if isinstance(entry, dict) else None
            if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
                raise self._error(f"its prompt log-probs miss token {seq[j]} at position {j} of {len(seq)} "
                                  "(misaligned, or another prompt's)")
            if math.isinf(value) and value < 0:  # JSON's -Infinity (vLLM sends -9999.0): a NaN term where masked
                raise self._error(f"its prompt log-prob of token {seq[j]} at position {j} is -inf (vLLM sends -9999.0 "
                                  "for it): not a log-prob a term can take")
            if value > LOGP_SLACK:
                raise self._error(f"its prompt log-prob of token {seq[j]} at position {j} is {value:g} > 0: "
                                  "logits, not log-probs (a server started with --logprobs-mode raw_logits or "
                                  "processed_logits; start it with raw_logprobs)")
            lp.append(float(value))
        return lp

    def _served(self) -> None:
        """/v1/models, once: the model (the only one, when none was named) and its max_model_len."""
        if self._asked:
            return
        models = (self._call("/v1/models", None, "/v1/models") or {}).get("data") or []
        ids = [str(m.get("id")) for m in models if isinstance(m, dict)]
        if not ids:
            raise self._error("/v1/models lists no model")
        if self.model is None and len(ids) > 1:
            raise self._error(f"serves {len(ids)} models ({', '.join(ids)}); name the teacher's")
        if self.model is not None and self.model not in ids:
            raise self._error(f"is not served there; it serves {', '.join(ids)}")
        self.model = self.model if self.model is not None else ids[0]
        self.max_model_len = int(models[ids.index(self.model)].get("max_model_len") or 0)
        self._asked = True

    def _call(self, path: str, body: dict | None, what: str):
        """The JSON answer of one request within the deadline; TeacherError otherwise."""
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        try:
            status, raw = exchange(self.url, path, body, headers=headers, timeout=self.timeout)
        except HTTPFailed as e:
            if e.late:
                raise self._error(f"no answer to {what} within {self.timeout:g} s") from None
            raise self._error(f"{what} failed ({_reason(e.cause)})") from None
        if status == 401:
            raise self._error(f"{what} refused the API key (401); give the teacher server's key")
        if status != 200:
            raise self._error(f"{what} answered {status} ({_cut(raw.decode(errors='replace'))})")
        try:
            return json.loads(raw) if raw else None
        except json.JSONDecodeError:
            raise self._error(f"{what} answered something that is not JSON ({raw[:80]!r})") from None

    def _error(self, what: str) -> TeacherError:
        return TeacherError(f"teacher {self.url}{f' ({self.model})' if self.model else ''}: {what}")


def base_url(url: str) -> str:
    """A server's base from what a user typed: http(s)://HOST:PORT, with or without /v1 (or a final /)."""
    try:
        return server_base(str(url).strip(), ("", "/v1"))
    except BadAddress as e:
        if e.port:
            raise TeacherError(f"teacher: {url!r} has an invalid port") from None
        raise TeacherError(f"teacher: {url!r} is not a server's address; expected http://HOST:PORT or "
                           "http://HOST:PORT/v1") from None


def _first_difference(tokenizer, ids: list[int], answer: dict) -> str:
    """Where the probe's tokens part: both ids and strings, and the student's vocabulary size."""
    theirs, strs = answer["tokens"], answer.get("token_strs") or []
    j = next((j for j, (a, b) in enumerate(zip(ids, theirs)) if a != b), min(len(ids), len(theirs)))
    mine = tokenizer.convert_ids_to_tokens(ids[j:j + 1])
    return (f"a fixed text's token {j} is {theirs[j] if j < len(theirs) else 'past its end'}"
            f"{f' ({strs[j]!r})' if j < len(strs) else ''} there and {ids[j] if j < len(ids) else 'past its end'}"
            f"{f' ({mine[0]!r})' if mine else ''} in the student's ({len(theirs)} and {len(ids)} tokens in all; "
            f"the student's vocabulary holds {len(tokenizer)}); cross-tokenizer distillation is not supported")


def _cut(x) -> str:
    return " ".join(str(x).split())[:200]
