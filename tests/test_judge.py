"""Judges as rewards (gspo.rewards.judge): the verdict's score, the template, the cache, a server
judge's faults, and runs that train on a judge (a local `tiny` and a fake OpenAI-compatible server)."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gspo.rewards.judge import Judge, JudgeOptions, ServerJudge, load_template, parse_verdict
from gspo.tasks.scoring import RewardError

FAST = ["--prompts-per-step", "2", "--group-size", "4", "--eval-size", "4", "--no-progress"]


def gspo(*args):
    return subprocess.run([sys.executable, "-m", "gspo", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "100"})


# ----------------------------------------------------------------------------------------------
# The parse rule
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, score", [
    ("VERDICT: CORRECT", 1.0),
    ("VERDICT: INCORRECT", 0.0),
    ("verdict - correct.", 1.0),
    ("**Verdict:** Incorrect", 0.0),
    ("The answer is correct.\nVERDICT: INCORRECT", 0.0),  # only the marker counts, not the word
    ("VERDICT: CORRECT ... wait, VERDICT: INCORRECT", 0.0),  # the last marker wins
    ("VERDICT: INCORRECT ... no: VERDICT: CORRECT", 1.0),
    ("Score: 7/10", 0.7),  # 7 / 10
    ("**Score:** 3 / 4", 0.75),  # 3 / 4
    ("score 1 out of 5", 0.2),  # 1 / 5
    ("Score: 8", 0.8),  # no denominator: out of 10, 8 / 10
    ("Score: 7.5/10", 0.75),
    ("Score: 10/10", 1.0),
    ("Score: 0/10", 0.0),
    ("Score: 2/10. On reflection, Score: 9/10", 0.9),  # the last marker wins
    ("Score: 4/10 then VERDICT: CORRECT", 1.0),  # either kind: the last
    ("VERDICT: CORRECT then Score: 4/10", 0.4),
    # unparsed: no marker, out of range, garbage
    ("Score: 11/10", None),  # above its denominator
    ("Score: 12", None),  # above 10 without one
    ("Score: -1/10", None),  # negative
    ("Score: 3/0", None),  # no denominator to divide by
    ("VERDICT: CORRECTNESS", None),  # not the word
    ("correct", None),
    ("7/10", None),  # a number without its marker
    ("", None),
    ("\x00<pad><pad> 1 1 1 ###", None),
])
def test_the_verdict_parse_rule(text, score):
    got = parse_verdict(text)
    assert got == (None if score is None else pytest.approx(score, rel=1e-9, abs=0)), (text, got)


# ----------------------------------------------------------------------------------------------
# The template
# ----------------------------------------------------------------------------------------------

def test_templates_and_their_one_line_errors(tmp_path):
    text, rubric = load_template(JudgeOptions())
    assert "{answer}" in text and "VERDICT: CORRECT" in text and rubric == ""
    (tmp_path / "rubric.txt").write_text("Polite, and under 20 words.")
    text, rubric = load_template(JudgeOptions(template="rubric", rubric=str(tmp_path / "rubric.txt")))
    assert rubric == "Polite, and under 20 words." and "Score: X/10" in text
    mine = tmp_path / "mine.txt"
    mine.write_text("Q: {prompt}\nA: {completion}\nKey: {answer}\n{{literal}}\nScore: X/10")
    text, _ = load_template(JudgeOptions(template=str(mine)))
    assert text.format(prompt="1+1", completion="2", answer="2", rubric="") == \
        "Q: 1+1\nA: 2\nKey: 2\n{literal}\nScore: X/10"

    bad = tmp_path / "bad.txt"
    cases = {
        "Q: {question}\nA: {completion}": f"judge_template {bad}: the field {{question}} is not one a judge fills "
                                          "(it fills {prompt}, {completion}, {answer}, {rubric})",
        "A: {completion.upper}": f"judge_template {bad}: the field {{completion.upper}} is not one",
        "A: {} {completion}": f"judge_template {bad}: the field {{}} is not one",
        "A: {completion": f"judge_template {bad}: not a str.format template",
        "By {rubric}: {completion}": f"judge_template {bad}: it uses {{rubric}}, and no --judge-rubric",
    }
    for content, msg in cases.items():
        bad.write_text(content)
        with pytest.raises(RewardError) as e:
            load_template(JudgeOptions(template=str(bad)))
        assert str(e.value).startswith(msg) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(RewardError, match="^judge_template 'nope': neither a built-in template"):
        load_template(JudgeOptions(template="nope"))
    with pytest.raises(RewardError, match=r"^judge_rubric: the template correctness has no \{rubric\} field"):
        load_template(JudgeOptions(rubric="be kind"))  # a rubric that would be ignored is refused


# ----------------------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------------------

class Counting:
    """A fake judge: says CORRECT when the completion equals the reference, and counts what it is asked."""

    def __init__(self):
        self.asked = []

    def __call__(self, texts):
        self.asked += texts
        return ["VERDICT: CORRECT" if t.split("|")[0].strip() == t.split("|")[1] else "VERDICT: INCORRECT"
                for t in texts]


def test_the_cache_asks_each_judge_prompt_once():
    fake = Counting()
    judge = Judge(fake, "{completion}|{answer}")
    # a group of 4 with two identical completions twice over: 2 distinct judge prompts
    scores = judge(completions=[" 4", " 4", "5", "5"], prompts=["2+2="] * 4, answer=["4"] * 4)
    assert scores == [1.0, 1.0, 0.0, 0.0] and fake.asked == [" 4|4", "5|4"]
    assert judge.last_metrics == {"unparsed_frac": [0.0] * 4, "cache_hit_frac": [0.0, 1.0, 0.0, 1.0]}
    # the next step: one seen completion (a hit), one new; the same completion against another answer is new
    scores = judge(completions=["5", "4", "4"], prompts=["2+2=", "2+2=", "1+3="], answer=["4", "4", "5"])
    assert scores == [0.0, 1.0, 0.0] and fake.asked == [" 4|4", "5|4", "4|4", "4|5"]
    assert judge.last_metrics["cache_hit_frac"] == [1.0, 0.0, 0.0]
    # garbage scores 0 and is counted
    garbage = Judge(lambda texts: ["I think so"] * len(texts), "{completion}")
    assert garbage(completions=["a", "b"], prompts=["p", "p"]) == [0.0, 0.0]
    assert garbage.last_metrics["unparsed_frac"] == [1.0, 1.0]


def test_a_judges_metrics_are_logged_outside_the_weighted_sum():
    from gspo.rewards.builtin import Reward, apply_rewards, exact_integer
    from gspo.tasks.scoring import per_completion

    judge = Judge(Counting(), "{completion}|{answer}")
    rewards = [Reward("exact_integer", per_completion(exact_integer), 1.0), Reward("judge", judge, 0.5)]
    total, per = apply_rewards(rewards, ["4", "4", "3"], {"prompts": ["2+2="] * 3, "answer": ["4"] * 3},
                               ["row 0"] * 3)
    assert total == [1.5, 1.5, 0.0]  # 1 * 1 + 0.5 * 1; 1 * 0 + 0.5 * 0
    assert per["judge/cache_hit_frac"] == [0.0, 1.0, 0.0] and per["judge/unparsed_frac"] == [0.0] * 3


# ----------------------------------------------------------------------------------------------
# A fake OpenAI-compatible judge server
# ----------------------------------------------------------------------------------------------

class FakeServer:
    """An OpenAI-compatible judge on 127.0.0.1: `verdict(judge prompt) -> text`; `chat=False` refuses
    chat (400, as vLLM for a model without a chat template); `hang` answers /v1/models, then never."""

    def __init__(self, verdict, *, chat=True, hang=False):
        self.verdict, self.chat, self.hang, self.requests = verdict, chat, hang, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_):
                pass

            def _send(self, status, obj):
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": "fake-judge", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, body))
                if outer.hang:
                    time.sleep(30)
                    return
                if self.path == "/v1/chat/completions":
                    if not outer.chat:
                        return self._send(400, {"error": {"message": "no chat template"}})
                    text = outer.verdict(body["messages"][-1]["content"])
                    return self._send(200, {"choices": [{"message": {"role": "assistant", "content": text}}]})
                self._send(200, {"choices": [{"text": outer.verdict(body["prompt"])}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_server_judge_chats_and_falls_back_to_completions():
    with FakeServer(lambda t: "Score: 6/10") as server:
        judge = ServerJudge.connect(server.url, JudgeOptions(max_new_tokens=9))
        assert judge.model == "fake-judge" and judge(["a", "b"]) == ["Score: 6/10"] * 2
        path, body = server.requests[0]
        assert path == "/v1/chat/completions" and body["temperature"] == 0.0 and body["max_tokens"] == 9
        assert body["model"] == "fake-judge"
    with FakeServer(lambda t: "VERDICT: CORRECT", chat=False) as server:
        judge = ServerJudge.connect(server.url + "#fake-judge", JudgeOptions())
        assert judge(["x"]) == ["VERDICT: CORRECT"] and judge(["y"]) == ["VERDICT: CORRECT"]
        assert [p for p, _ in server.requests] == ["/v1/chat/completions", "/v1/completions", "/v1/completions"]
        with pytest.raises(RewardError, match=r"GET /v1/models lists \['fake-judge'\], not 'other'"):
            ServerJudge.connect(server.url + "#other", JudgeOptions())


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on leaving: nothing listens there


def test_an_exchange_with_a_closed_port_fails_at_once():
    from gspo.io.http import HTTPFailed, exchange

    with pytest.raises(HTTPFailed) as e:
        exchange(f"http://127.0.0.1:{_closed_port()}", "/v1/models", None, headers={}, timeout=5)
    assert isinstance(e.value.cause, ConnectionRefusedError) and not e.value.late


def test_garbage_http_is_one_line():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def answer_garbage():
        conn, _ = listener.accept()
        conn.recv(4096)
        conn.sendall(b"this is not HTTP\r\n\r\n")
        conn.close()

    threading.Thread(target=answer_garbage, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    with pytest.raises(RewardError) as e:
        ServerJudge.connect(url, JudgeOptions(timeout=5))
    listener.close()
    assert str(e.value).startswith(f"judge {url}: GET /v1/models failed (") and "\n" not in str(e.value)


@pytest.mark.slow  # a process
def test_a_dead_judge_is_refused_in_one_line_before_anything_is_written(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}"
    r = gspo("train", *FAST, "--steps", "1", "--reward", f"judge:{url}", "--output-dir", str(tmp_path / "out"))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [f"gspo train: error: judge {url}: GET /v1/models failed "
                                             "([Errno 111] Connection refused)"], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


@pytest.mark.slow  # trains
def test_a_judge_that_hangs_mid_run_stops_it_in_one_line(tmp_path, capsys):
    from gspo.cli import main

    with FakeServer(lambda t: "", hang=True) as server:
        t0 = time.monotonic()
        code = main(["train", *FAST, "--steps", "1", "--reward", f"judge:{server.url}", "--judge-timeout", "1",
                     "--output-dir", str(tmp_path / "out")])
        took = time.monotonic() - t0
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"gspo train: error: judge {server.url}: no answer to POST /v1/chat/completions "
                                 "within 1 s (--judge-timeout)"], err
    assert took < 25  # the deadline, not the server's 30 s sleep


@pytest.mark.slow  # trains
def test_a_server_judges_verdicts_train_the_policy(tmp_path):
    """The fake judge agrees with exact_integer row for row, so its mean is exact_integer's and the
    weighted reward 1 * exact + 0.5 * judge = 1.5 * exact."""
    import gspo

    def verdict(text):  # the template below: "COMPLETION|ANSWER"
        completion, answer = text.rsplit("|", 1)
        return "Score: 10/10" if completion.strip() == answer else "Score: 0/10"

    template = tmp_path / "t.txt"
    template.write_text("{completion}|{answer}")
    with FakeServer(verdict) as server:
        cfg = gspo.TrainConfig(steps=1, prompts_per_step=4, group_size=4, eval_size=4, progress=False,
                               reward=("exact_integer", f"judge:{server.url}"), reward_weights=(1.0, 0.5),
                               judge_template=str(template), output_dir=str(tmp_path / "run"))
        gspo.Trainer(cfg).train()
        asked = len(server.requests)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    exact = row["reward/exact_integer/mean"]
    assert row["reward/judge/mean"] == pytest.approx(exact, abs=1e-12)
    assert row["reward/mean"] == pytest.approx(1.5 * exact, rel=1e-6)
    assert row["judge/unparsed_frac"] == 0.0
    # 16 completions; those the cache answered were not asked (held-out eval asks too: 4 more at most)
    assert asked <= 16 - round(row["judge/cache_hit_frac"] * 16) + 4


@pytest.mark.slow  # a process that trains
def test_a_local_tiny_judge_end_to_end(tmp_path):
    run = tmp_path / "run"
    r = gspo("train", *FAST, "--steps", "1", "--reward", "exact_integer", "judge:tiny", "--reward-weights", "1",
             "0.5", "--judge-max-new-tokens", "8", "--output-dir", str(run))
    assert r.returncode == 0, r.stderr
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    # tiny is no judge: its verdicts are garbage, each scored 0 and counted
    assert row["reward/judge/mean"] == 0.0 and row["judge/unparsed_frac"] == 1.0
    assert row["reward/mean"] == pytest.approx(row["reward/exact_integer/mean"], rel=1e-6)
    assert 0.0 <= row["judge/cache_hit_frac"] <= 1.0


def test_judge_options_without_a_judge_are_refused(tmp_path, capsys):
    from gspo.cli import main

    assert main(["train", *FAST, "--steps", "1", "--judge-timeout", "5", "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gspo train: error: --judge-timeout 5: applies to judges, and no --reward is one "
                   "(judge:MODEL_OR_URL)"], err
