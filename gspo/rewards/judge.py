"""Judges: a language model that reads a completion and writes a verdict, as a reward (LLM-as-judge).

    gspo train --reward exact_integer judge:Qwen/Qwen3-0.6B --reward-weights 1 0.5
    gspo train --reward judge:http://10.0.0.5:8000 --judge-template rubric --judge-rubric rubric.txt

    judge = Judge.load("judge:tiny", JudgeOptions(), device="cpu")
    judge(completions=[" 4"], prompts=["2+2="], answer=["4"])   # [score in [0, 1]]
    judge.last_metrics                                          # {"unparsed_frac": [...], "cache_hit_frac": [...]}

`--reward judge:SPEC` names the judge:

- a model, in any form `--model` takes (a built-in name, a local directory, a hub id, a `.gguf`
  file: gspo.models.loading.load_policy), loaded frozen in eval mode on `--reward-model-device`
  (else the policy's device), float32 on the CPU and bfloat16 on an accelerator. It answers
  greedily, `--judge-max-new-tokens` at most, in batches of `--reward-model-batch-size` with
  left padding, with its own tokenizer; the judge prompt is one user message rendered by its own
  chat template when it has one, else the plain text.
- `http://` or `https://` HOST:PORT: an OpenAI-compatible server (vLLM, llama.cpp's, ...),
  asked at start for its models (`GET /v1/models`, the first one listed is the judge; name
  another as the URL's fragment, `http://host:8000#Qwen/Qwen3-8B`). Each judge prompt is one
  `POST /v1/chat/completions` (a user message, temperature 0, `max_tokens`
  `--judge-max-new-tokens`); a server that refuses chat for its model (a 4xx: no chat template)
  is asked `/v1/completions` with the plain text instead, from then on. A batch's requests go
  out together, 8 at a time. A key, when the server wants one, comes from GSPO_JUDGE_API_KEY.

The judge prompt is a template (`--judge-template`): `correctness` (the default: the completion
against the example's reference answer, answered `VERDICT: CORRECT` or `VERDICT: INCORRECT`),
`rubric` (the completion against `--judge-rubric`, text or a file, answered `Score: X/10`), or
a file of your own: Python str.format text with the fields `{prompt}`, `{completion}`,
`{answer}` and `{rubric}` (literal braces doubled, `{{`). A field outside those four, or
`{rubric}` without `--judge-rubric`, or a rubric that no field uses, is a one-line error at start.

The verdict's score (`parse_verdict`): the LAST marker in the text wins, case-insensitive, with
markdown (`**Score:** 7/10`) allowed:
    `VERDICT: CORRECT` -> 1.0, `VERDICT: INCORRECT` -> 0.0,
    `Score: X/N` (or `X out of N`) -> X / N when 0 <= X <= N and N > 0,
    `Score: X` -> X / 10 when 0 <= X <= 10.
Anything else (no marker, a number out of range) is UNPARSED: it scores 0.0 and is counted.

Cache: each judge prompt (it holds the prompt, the completion, the reference answer, the rubric
and the template) is judged once per run, in memory; identical completions in a group cost one
call. Per step, `judge/unparsed_frac` and `judge/cache_hit_frac` (the share of the step's
completions whose verdict was unparsed / came from the cache) are logged beside `reward/judge/mean`.

Faults: each server request has a deadline (`--judge-timeout` seconds, gspo.io.http); a server
that refuses, hangs past it, or answers something that is not an OpenAI answer stops the run with
one line naming the judge's URL (a RewardError). Left out: retries, judges that need
trust_remote_code, truncating judge prompts longer than the judge's context, sampling verdicts.
"""

from __future__ import annotations

import json
import os
import re
import string
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from gspo.config.checks import one_line
from gspo.io.http import BadAddress, HTTPFailed, exchange, server_base
from gspo.tasks.scoring import RewardError, completion_text

PREFIX = "judge:"
KEY_VARIABLE = "GSPO_JUDGE_API_KEY"
FIELDS = ("prompt", "completion", "answer", "rubric")
CONCURRENCY = 8  # a server judge's requests under way at once
# the 4xx answers that say a route is not served for the model (vLLM's 400 for a model without a chat
# template; a server without the route); 401, 408, 413, 429 say nothing of the route and stop the run
REFUSES_ROUTE = (400, 404, 405, 422)

TEMPLATES = {
    "correctness": (
        "You are grading an answer to a task.\n\n"
        "Task:\n{prompt}\n\n"
        "Reference answer:\n{answer}\n\n"
        "Answer to grade:\n{completion}\n\n"
        "Does the answer to grade give the same final answer as the reference answer? "
        "Reply with one line: VERDICT: CORRECT or VERDICT: INCORRECT."
    ),
    "rubric": (
        "You are grading a response against a rubric.\n\n"
        "Rubric:\n{rubric}\n\n"
        "Task:\n{prompt}\n\n"
        "Response:\n{completion}\n\n"
        "Grade the response against the rubric. Be brief, then end with one line: Score: X/10, "
        "X a whole number from 0 (fails the rubric) to 10 (meets it fully)."
    ),
}


@dataclass(frozen=True)
class JudgeOptions:
    """What a judge reward is configured by (the Rewards section's judge_* options)."""

    template: str = "correctness"  # a built-in template's name, or a file
    rubric: str | None = None  # text, or a file
    max_new_tokens: int = 64  # the longest verdict
    timeout: float = 60.0  # seconds: one server request


# ----------------------------------------------------------------------------------------------
# The verdict's score
# ----------------------------------------------------------------------------------------------

_NUM = r"(-?\d+(?:\.\d+)?)"
_MARKER = re.compile(rf"verdict\W*(?P<verdict>incorrect|correct)\b"
                     rf"|score\W*?{_NUM}(?:[*_]*\s*(?:/|out\s+of)\s*[*_]*{_NUM})?", re.IGNORECASE)  # **4**/5


def parse_verdict(text: str) -> float | None:
    """The score in [0, 1] of a verdict's LAST marker (module docstring); None when unparsed.

    >>> parse_verdict("VERDICT: CORRECT"), parse_verdict("**Verdict:** incorrect"), parse_verdict("correct!")
    (1.0, 0.0, None)
    >>> parse_verdict("Score: 7/10"), parse_verdict("score 3 out of 4"), parse_verdict("Score: 5")
    (0.7, 0.75, 0.5)
    >>> parse_verdict("Score: 2/10 ... on reflection, Score: 9/10"), parse_verdict("Score: 11/10")
    (0.9, None)
    """
    found = list(_MARKER.finditer(text))
    if not found:
        return None
    m = found[-1]
    if m["verdict"]:
        return 1.0 if m["verdict"].lower() == "correct" else 0.0
    x, n = float(m[2]), float(m[3]) if m[3] is not None else 10.0
    return x / n if n > 0 and 0 <= x <= n else None


# ----------------------------------------------------------------------------------------------
# The template
# ----------------------------------------------------------------------------------------------


def load_template(options: JudgeOptions) -> tuple[str, str]:
    """(template text, rubric text) from the options: a built-in template or a file, its fields
    checked against FIELDS and the rubric; any fault is one RewardError line naming the file."""
    where = options.template
    if where in TEMPLATES:
        text = TEMPLATES[where]
    elif Path(where).expanduser().is_file():
        text = Path(where).expanduser().read_text()
    else:
        raise RewardError(f"judge_template {where!r}: neither a built-in template ({', '.join(TEMPLATES)}) "
                          "nor a file")
    rubric = options.rubric or ""
    if rubric and Path(rubric).expanduser().is_file():
        rubric = Path(rubric).expanduser().read_text()
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
    except ValueError as e:  # a lone brace
        raise RewardError(f"judge_template {where}: not a str.format template ({e}; a literal brace is "
                          "written {{ or }})") from None
    if unknown := sorted(names - set(FIELDS)):
        raise RewardError(f"judge_template {where}: the field {{{unknown[0]}}} is not one a judge fills "
                          f"(it fills {', '.join('{' + f + '}' for f in FIELDS)})")
    if "rubric" in names and not rubric.strip():
        raise RewardError(f"judge_template {where}: it uses {{rubric}}, and no --judge-rubric (text or a file) "
                          "is given")
    if rubric and "rubric" not in names:
        raise RewardError(f"judge_rubric: the template {where} has no {{rubric}} field to put it in "
                          "(--judge-template rubric has one)")
    return text, rubric


def prompt_text(prompt) -> str:
    """A prompt as the judge reads it: the text, or chat messages one `role: content` line each.

    >>> prompt_text("2+2="), prompt_text([{"role": "user", "content": "2+2?"}])
    ('2+2=', 'user: 2+2?')
    """
    if isinstance(prompt, list):
        return "\n".join(f"{m.get('role', 'user')}: {completion_text([m])}" for m in prompt if isinstance(m, dict))
    return str(prompt)


# ----------------------------------------------------------------------------------------------
# Who answers: a local model, or an OpenAI-compatible server
# ----------------------------------------------------------------------------------------------


class LocalJudge:
    """A causal LM and its own tokenizer: greedy verdicts, a batch at a time, left padded."""

    def __init__(self, model, tokenizer, *, max_new_tokens: int, batch_size: int):
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size

    @classmethod
    def load(cls, spec: str, options: JudgeOptions, *, device, batch_size: int) -> LocalJudge:
        from gspo.models.loading import load_policy, prepare_tokenizer, resolve_device

        device = resolve_device(device) if isinstance(device, str) else torch.device(device)
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        try:
            model, tokenizer = load_policy(spec, dtype=dtype, device=device)
            tokenizer = prepare_tokenizer(tokenizer, f"judge {spec}")
        except Exception as e:  # ModelError, HubError, a model transformers cannot build
            raise RewardError(f"reward 'judge:{spec}': cannot load the judge model: {one_line(e)[:300]}") from None
        model.eval().requires_grad_(False)
        return cls(model, tokenizer, max_new_tokens=options.max_new_tokens, batch_size=batch_size)

    def __call__(self, texts: list[str]) -> list[str]:
        tok, out = self.tokenizer, []
        chat = bool(getattr(tok, "chat_template", None))
        if chat:
            texts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                             add_generation_prompt=True) for t in texts]
        device = next(self.model.parameters()).device
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                enc = tok(text=texts[i:i + self.batch_size], return_tensors="pt", padding=True,
                          padding_side="left", add_special_tokens=not chat).to(device)
                ids = self.model.generate(**enc, max_new_tokens=self.max_new_tokens, do_sample=False,
                                          temperature=None, top_p=None, top_k=None,
                                          pad_token_id=tok.pad_token_id)  # (b, T + new)
                new = ids[:, enc["input_ids"].shape[1]:]  # (b, new)
                out += tok.batch_decode(new, skip_special_tokens=True)
        return out


class ServerJudge:
    """An OpenAI-compatible server's model: one request per judge prompt, CONCURRENCY at once."""

    def __init__(self, url: str, model: str, options: JudgeOptions, key: str | None = None):
        self.url, self.model, self.key = url, model, key
        self.max_new_tokens, self.timeout = options.max_new_tokens, options.timeout
        self.route = "/v1/chat/completions"  # /v1/completions once the server refuses chat

    @classmethod
    def connect(cls, spec: str, options: JudgeOptions) -> ServerJudge:
        """The server of `spec` (http[s]://HOST:PORT[/v1][#MODEL]), checked: it answers /v1/models
        within the deadline and serves the model asked for (else its first)."""
        try:
            base = server_base(spec, ("", "/v1"), fragment=True)
        except BadAddress:
            raise RewardError(f"reward 'judge:{spec}': not a server's address; expected judge:http://HOST:PORT "
                              "(optionally #MODEL)") from None
        judge = cls(base, "", options, os.environ.get(KEY_VARIABLE) or None)
        listed = judge.call("/v1/models", None)
        ids = [m.get("id") for m in (listed or {}).get("data", []) if isinstance(m, dict) and m.get("id")] \
            if isinstance(listed, dict) else []
        want = urllib.parse.unquote(urllib.parse.urlsplit(spec).fragment)
        if not ids or (want and want not in ids):
            raise RewardError(f"judge {judge.url}: GET /v1/models lists {ids or 'no model'}"
                              + (f", not {want!r}" if want and ids else ""))
        judge.model = want or ids[0]
        return judge

    def call(self, path: str, body: dict | None, *, quiet: bool = False):
        """The JSON answer of one request within the deadline; a RewardError naming the judge otherwise.
        quiet: a 4xx answer that refuses the route (REFUSES_ROUTE) is returned as None (the caller tries another
        route)."""
        what = f"{'POST' if body is not None else 'GET'} {path}"
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        try:
            status, raw = exchange(self.url, path, body, headers=headers, timeout=self.timeout)
        except HTTPFailed as e:
            if e.late:
                raise RewardError(f"judge {self.url}: no answer to {what} within {self.timeout:g} s "
                                  "(--judge-timeout)") from None
            raise RewardError(f"judge {self.url}: {what} failed ({(one_line(e.cause) or type(e.cause).__name__)[:200]})"
                              ) from None
        if quiet and status in REFUSES_ROUTE:
            return None
        if status != 200:
            hint = f"; give the server's key in {KEY_VARIABLE}" if status == 401 else ""
            raise RewardError(f"judge {self.url}: {what} answered {status} "
                              f"({' '.join(raw.decode(errors='replace').split())[:200]}){hint}")
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise RewardError(f"judge {self.url}: {what} answered something that is not JSON ({raw[:80]!r})") from None

    def one(self, text: str) -> str:
        """One judge prompt's verdict: chat, or plain completions where the server refuses chat."""
        common = {"model": self.model, "max_tokens": self.max_new_tokens, "temperature": 0.0}
        if self.route == "/v1/chat/completions":
            answer = self.call(self.route, {**common, "messages": [{"role": "user", "content": text}]}, quiet=True)
            if answer is not None:
                return self._text(answer, "message")
            self.route = "/v1/completions"  # no chat template: plain text from here on
        return self._text(self.call(self.route, {**common, "prompt": text}), "text")

    def _text(self, answer, key: str) -> str:
        try:
            choice = answer["choices"][0]
            text = choice["message"]["content"] if key == "message" else choice["text"]
        except (KeyError, IndexError, TypeError):
            raise RewardError(f"judge {self.url}: POST {self.route} answered without a choice's "
                              f"{'message' if key == 'message' else 'text'} ({str(answer)[:120]})") from None
        return text or ""

    def __call__(self, texts: list[str]) -> list[str]:
        if not texts:
            return []
        with ThreadPoolExecutor(min(CONCURRENCY, len(texts)), thread_name_prefix="gspo-judge") as pool:
            return list(pool.map(self.one, texts))


# ----------------------------------------------------------------------------------------------
# The reward
# ----------------------------------------------------------------------------------------------


class Judge:
    """A judge as a reward: renders the template, asks `answer` (texts -> verdicts) what it has
    not asked before, and scores each verdict with parse_verdict (unparsed: 0.0, counted)."""

    def __init__(self, answer, template: str, rubric: str = "", name: str = "judge"):
        self.answer, self.template, self.rubric = answer, template, rubric
        self.cache: dict[str, str] = {}  # judge prompt -> verdict, for the run
        self.last_metrics: dict[str, list[float]] = {}
        self.__name__ = name  # the metric name: reward/judge/mean

    @classmethod
    def load(cls, spec: str, options: JudgeOptions, *, device=None, batch_size: int = 32) -> Judge:
        """The judge of `--reward judge:...`: a server for a URL, else a model loaded on `device`."""
        target = spec.removeprefix(PREFIX)
        template, rubric = load_template(options)
        if not target:
            raise RewardError("reward 'judge:': name the judge: judge:MODEL (as --model takes it) or judge:http://HOST:PORT")
        if target.startswith(("http://", "https://")):
            answer = ServerJudge.connect(target, options)
        else:
            answer = LocalJudge.load(target, options, device=device or "cpu", batch_size=batch_size)
        return cls(answer, template, rubric)

    def render(self, prompt, completion, answer) -> str:
        return self.template.format(prompt=prompt_text(prompt), completion=completion_text(completion),
                                    answer="(none)" if answer is None else str(answer), rubric=self.rubric)

    def __call__(self, completions: list, prompts: list, answer: list | None = None, **_) -> list[float]:
        answers = answer if answer is not None else [None] * len(completions)
        texts = [self.render(p, c, a) for p, c, a in zip(prompts, completions, answers, strict=True)]
        new = [t for t in dict.fromkeys(texts) if t not in self.cache]  # each unseen prompt once
        hits = [t in self.cache or t in texts[:i] for i, t in enumerate(texts)]  # from the cache, or a repeat
        verdicts = self.answer(new)
        if len(verdicts) != len(new):
            raise RewardError(f"judge: {len(verdicts)} verdicts for {len(new)} judge prompts")
        self.cache.update(zip(new, verdicts))
        scores = [parse_verdict(self.cache[t]) for t in texts]
        self.last_metrics = {"unparsed_frac": [float(s is None) for s in scores],
                             "cache_hit_frac": [float(h) for h in hits]}
        return [0.0 if s is None else s for s in scores]


def is_judge(spec) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def is_local_judge(spec) -> bool:
    """A judge that is a model gspo loads (it uses --reward-model-device and --reward-model-batch-size)."""
    return is_judge(spec) and not spec.removeprefix(PREFIX).startswith(("http://", "https://"))
