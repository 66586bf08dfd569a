"""Inputs the distillation code was not built for (a reviewer's): each test one defect found."""

from __future__ import annotations

import json

from gspo.cli import main

FAST = ["--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "8", "--eval-size", "8", "--no-progress"]


def test_a_context_field_only_some_rows_have_is_refused_at_the_start(tmp_path, capsys, monkeypatch):
    # --teacher-context was checked against the first example only: a dataset whose field is missing
    # from later rows crashed mid-run with a KeyError traceback, after the run directory was written
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "partial.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1),
                                        **({"hint": f"it is {i + 1}"} if i % 2 == 0 else {})}) + "\n"
                            for i in range(40)))
    run = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "3", "--dataset", str(data), "--prompt-column", "question",
                 "--reward", "exact_match", "--teacher", "self", "--teacher-context", " hint: {hint}",
                 "--output-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "teacher_context: names the field 'hint'" in err[0], err
    assert not run.exists()


def test_a_served_teacher_answering_minus_infinity_is_refused(monkeypatch):
    # JSON as Python reads it carries -Infinity (vLLM itself sends -9999.0 for -inf): the NaN check let it
    # through, and -inf becomes a token's advantage, NaN where the mask is 0 (-inf · 0): a NaN loss
    import pytest

    from gspo.sampling import teacher_server
    from gspo.sampling.teacher_server import ServedTeacher, TeacherError

    def answer(url, path, body, **kw):
        if path == "/v1/models":
            return 200, json.dumps({"data": [{"id": "t", "max_model_len": 64}]}).encode()
        seq = body["prompt"]
        entries = [None] + [{str(t): {"logprob": -1.0, "rank": 1}} for t in seq[1:]]
        entries[-1] = {str(seq[-1]): {"logprob": "-Infinity", "rank": 1}}
        raw = json.dumps({"choices": [{"text": "", "prompt_logprobs": entries}]})
        return 200, raw.replace('"-Infinity"', "-Infinity").encode()

    monkeypatch.setattr(teacher_server, "exchange", answer)
    with pytest.raises(TeacherError, match="position 3"):
        ServedTeacher("http://127.0.0.1:1").logprobs([[5, 6, 7, 8]], [2])


def test_a_self_teacher_with_stale_sampling_log_probs_is_refused(tmp_path, capsys, monkeypatch):
    # --teacher self --old-logp sampling --max-staleness 1: the teacher is the policy at step k, the
    # student's log-probs the sampler's at k-1, so even an empty context gave a nonzero term
    # (log π_k − log π_k-1, reverse_kl 0.0025 at step 2 with --teacher-context ''): the drift, as distillation
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "1", "--teacher", "self", "--teacher-context", "{answer}",
                 "--max-staleness", "1", "--old-logp", "sampling", "--output-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "old_logp: sampling with --teacher self and --max-staleness > 0" in err[0], err
    assert not run.exists()


def test_a_self_teacher_with_an_empty_context_is_refused(tmp_path, capsys, monkeypatch):
    # --teacher-context '' passed the "is needed by --teacher self" rule (it checked None alone): the teacher
    # is then the student, and the run trains on a term that is 0 (or the sampler's noise) by construction
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = tmp_path / "run"
    assert main(["train", *FAST, "--steps", "1", "--teacher", "self", "--teacher-context", "",
                 "--output-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "teacher_context: is needed by --teacher self" in err[0], err
    assert not run.exists()


def test_teacher_and_judge_paths_are_saved_absolute(tmp_path, monkeypatch):
    # absolute_paths left --teacher DIR (and NAME=DIR), judge:DIR and --judge-rubric FILE as typed: a run
    # resumed (or evaluated) from another directory read them there: a missing teacher, or, silently, a
    # rubric that is no longer a file taken as the rubric's text ("rubric.txt")
    from gspo.config import TrainConfig
    from gspo.train.resolve import absolute_paths

    monkeypatch.chdir(tmp_path)
    (tmp_path / "rubric.txt").write_text("Be exact.")
    (tmp_path / "teach").mkdir()
    cfg = absolute_paths(TrainConfig(reward=("judge:teach", "exact_integer"), judge_template="rubric",
                                     judge_rubric="rubric.txt",
                                     teacher=("teach", "chain_sum=teach", "self", "http://h:1", "tiny")))
    t = str(tmp_path.resolve() / "teach")
    assert cfg.rewards.reward == (f"judge:{t}", "exact_integer")
    assert cfg.rewards.judge_rubric == str(tmp_path.resolve() / "rubric.txt")
    assert cfg.rewards.judge_template == "rubric"
    assert cfg.distill.teacher == (t, f"chain_sum={t}", "self", "http://h:1", "tiny")


def test_a_rate_limited_chat_judge_does_not_switch_to_plain_completions(monkeypatch):
    # any 4xx but 401 on /v1/chat/completions switched the judge to /v1/completions with the plain text
    # (no chat template) for the rest of the run: one 429 of a busy gateway silently changed how every
    # later verdict was asked
    import pytest

    from gspo.rewards import judge as judge_module
    from gspo.rewards.judge import JudgeOptions, RewardError, ServerJudge

    asked = []

    def answer(url, path, body, **kw):
        asked.append(path)
        if path == "/v1/chat/completions":
            return 429, b'{"error": "rate limited"}'
        return 200, json.dumps({"choices": [{"text": "VERDICT: CORRECT"}]}).encode()

    monkeypatch.setattr(judge_module, "exchange", answer)
    judge = ServerJudge("http://127.0.0.1:1", "m", JudgeOptions())
    with pytest.raises(RewardError, match="429"):
        judge.one("grade this")
    assert judge.route == "/v1/chat/completions" and asked == ["/v1/chat/completions"]


def test_a_bold_score_before_its_scale_is_read_against_the_scale():
    # "**Score: 4**/5" was read as Score: 4 (out of 10): 0.4 for a 4/5, silently
    from gspo.rewards.judge import parse_verdict

    assert parse_verdict("**Score: 4**/5") == 0.8
    assert parse_verdict("Score: **7** out of **10**") == 0.7
    assert parse_verdict("**Score:** 4/5") == 0.8 and parse_verdict("Score: 5") == 0.5
