"""gspo.sampling.teacher_server against the fake vLLM server (tests/fakevllm.py): a served teacher's
log-probs of the student's tokens, its checks at start, and every way a server fails as one line.

The fake scores prompt token t at token_logp(t) = -0.1 * (t % 7 + 1), whatever its context; the real
server's values are compared with a local forward in tests/test_vllm_server.py.
"""

import socket
import time

import pytest

import tests.fakevllm as fakevllm
from gspo.sampling.teacher_server import PROBE, ServedTeacher, TeacherError, base_url
from tests.fakevllm import CharTokenizer, FakeVLLM, token_logp


def one_line(e: pytest.ExceptionInfo, url: str) -> str:
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"teacher {url}"), text
    return text


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed


# --- the values --------------------------------------------------------------------------------


def test_log_probs_round_trip_exactly_from_each_start():
    seqs = [[3, 9, 4, 1, 7], [5, 5, 12], [8, 2, 6, 11]]
    starts = [1, 2, 4]  # the last: nothing to score, and nothing asked
    with FakeVLLM() as fake:
        lp = ServedTeacher(fake.url).logprobs(seqs, starts)
        bodies = [r.body for r in fake.asked("/v1/completions")]
    # seq 0 from 1: tokens 9, 4, 1, 7 -> -0.1 * (9%7+1, 4%7+1, 1%7+1, 7%7+1) = -0.3, -0.5, -0.2, -0.1
    assert lp[0] == pytest.approx([-0.3, -0.5, -0.2, -0.1], abs=1e-12)
    assert lp[1] == pytest.approx([token_logp(12)], abs=1e-12) and lp[1] == pytest.approx([-0.6])  # 12 % 7 + 1 = 6
    assert lp[2] == []
    assert sorted(b["prompt"] for b in bodies) == sorted(seqs[:2])  # token ids, as they are
    assert all(b["max_tokens"] == 1 and b["prompt_logprobs"] == 0 and b["model"] == "tiny-model" for b in bodies)


def test_a_batch_of_256_sequences_of_1000_tokens():
    seqs = [[(7 * i + j * j) % 50 for j in range(1000)] for i in range(256)]
    starts = [100 + i for i in range(256)]  # each its own prompt length
    with FakeVLLM(max_model_len=2048) as fake:  # ~3 s here, most of it the fake's JSON (one process, one GIL)
        lp = ServedTeacher(fake.url, concurrency=8).logprobs(seqs, starts)
        assert len(fake.asked("/v1/completions")) == 256
    assert [len(x) for x in lp] == [1000 - s for s in starts]
    assert all(x == [token_logp(t) for t in seq[s:]] for x, seq, s in zip(lp, seqs, starts))


def test_the_url_as_users_type_it():
    assert base_url("http://10.0.0.7:8000") == base_url("http://10.0.0.7:8000/v1/") == "http://10.0.0.7:8000"
    for bad in ("10.0.0.7:8000", "http://h:8000/api", "ftp://h:8000", "http://h:x"):
        with pytest.raises(TeacherError, match="teacher: "):
            ServedTeacher(bad)


def test_starts_are_checked_before_anything_is_asked():
    with FakeVLLM() as fake:
        teacher = ServedTeacher(fake.url)
        with pytest.raises(ValueError, match="a start of 0"):
            teacher.logprobs([[1, 2]], [0])
        with pytest.raises(ValueError, match="2 sequences and 1 starts"):
            teacher.logprobs([[1, 2], [3, 4]], [1])
        assert fake.requests == []


def test_a_sequence_longer_than_the_server_holds_is_refused_before_it_is_sent():
    with FakeVLLM(max_model_len=64) as fake:
        with pytest.raises(TeacherError) as e:
            ServedTeacher(fake.url).logprobs([[1] * 63, [1] * 64], [1, 1])  # 63 + 1 fits, 64 + 1 does not
        assert "max_model_len 64" in one_line(e, fake.url) and "--max-model-len 65" in str(e.value)
        assert fake.asked("/v1/completions") == []


# --- a server that fails -----------------------------------------------------------------------


def test_a_dead_server_is_one_line():
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(TeacherError) as e:
        ServedTeacher(url, timeout=2.0).logprobs([[1, 2, 3]], [1])
    assert "/v1/models failed (" in one_line(e, url)


def test_a_hung_server_is_one_line_at_the_deadline():
    with FakeVLLM(delay={"/v1/completions": 3.0}) as fake:
        t0 = time.monotonic()
        with pytest.raises(TeacherError) as e:
            ServedTeacher(fake.url, timeout=0.3).logprobs([[1, 2, 3]] * 4, [1] * 4)
        assert time.monotonic() - t0 < 1.5
    assert "no answer to the prompt log-probs of 3 tokens within 0.3 s" in one_line(e, fake.url)


@pytest.mark.parametrize("fault, said", [("no_prompt_logprobs", "got none"),
                                         ("shifted_prompt_logprobs", "miss token 2 at position 1 of 3"),
                                         ("status", "answered 500")])
def test_a_wrong_answer_is_one_line(fault, said):
    with FakeVLLM() as fake:
        if fault == "status":
            fake.status = {"/v1/completions": 500}
        else:
            setattr(fake, fault, True)
        with pytest.raises(TeacherError) as e:
            ServedTeacher(fake.url).logprobs([[1, 2, 3], [4, 5, 6]], [1, 1])
    assert said in one_line(e, fake.url) and "(tiny-model)" in str(e.value)


def test_logits_in_place_of_log_probs_are_refused(monkeypatch):
    monkeypatch.setattr(fakevllm, "token_logp", lambda t: 0.5)  # a server in --logprobs-mode raw_logits
    with FakeVLLM() as fake:
        with pytest.raises(TeacherError) as e:
            ServedTeacher(fake.url).logprobs([[1, 2, 3]], [1])
    assert "is 0.5 > 0: logits, not log-probs" in one_line(e, fake.url)


def test_the_api_key():
    with FakeVLLM(key="secret") as fake:
        assert ServedTeacher(fake.url, key="secret").logprobs([[1, 2]], [1]) == [[token_logp(2)]]
        with pytest.raises(TeacherError) as e:
            ServedTeacher(fake.url, key="wrong").logprobs([[1, 2]], [1])
    assert "refused the API key (401)" in one_line(e, fake.url)


# --- the model and the vocabulary --------------------------------------------------------------


def test_several_models_and_none_named():
    with FakeVLLM(more_models=["big-teacher"]) as fake:
        with pytest.raises(TeacherError) as e:
            ServedTeacher(fake.url).logprobs([[1, 2]], [1])
        assert "serves 2 models (tiny-model, big-teacher); name the teacher's" in one_line(e, fake.url)
        with pytest.raises(TeacherError) as e:
            ServedTeacher(fake.url, model="other").logprobs([[1, 2]], [1])
        assert "(other): is not served there; it serves tiny-model, big-teacher" in one_line(e, fake.url)
        assert ServedTeacher(fake.url, model="big-teacher").logprobs([[1, 2]], [1]) == [[token_logp(2)]]
        assert fake.asked("/v1/completions")[-1].body["model"] == "big-teacher"


def test_the_check_passes_a_server_with_the_students_tokenizer(char_tokenizer):
    with FakeVLLM(tokenizer=char_tokenizer) as fake:
        ServedTeacher(fake.url).check(char_tokenizer)
        [tok] = fake.asked("/tokenize")
        scored = fake.asked("/v1/completions")
    assert tok.body == {"model": "tiny-model", "prompt": PROBE, "add_special_tokens": False, "return_token_strs": True}
    assert len(PROBE) > 200 and any(ord(c) > 0xFFFF for c in PROBE) and any(c.isdigit() for c in PROBE)
    assert len(scored) == 1 and len(scored[0].body["prompt"]) == 63  # the probe, within max_model_len 64


def test_another_tokenizer_is_refused_naming_both(char_tokenizer):
    from gspo.models.tiny import build_chat_tokenizer

    student = build_chat_tokenizer()
    with FakeVLLM(tokenizer=char_tokenizer) as fake:
        with pytest.raises(TeacherError) as e:
            ServedTeacher(fake.url).check(student)
    text = one_line(e, fake.url)
    ids = student.encode(PROBE, add_special_tokens=False)
    theirs = char_tokenizer.encode(PROBE, add_special_tokens=False)
    j = next(j for j, (a, b) in enumerate(zip(ids, theirs)) if a != b)
    assert "(tiny-model): its tokenizer is not the student's: a fixed text's token" in text
    assert f"token {j} is {theirs[j]} ({char_tokenizer.convert_ids_to_tokens(theirs[j])!r}) there" in text
    assert f"and {ids[j]} ({student.convert_ids_to_tokens(ids[j])!r}) in the student's" in text
    assert f"the student's vocabulary holds {len(student)}" in text


def test_a_smaller_teacher_vocabulary_is_refused():
    # every character of the probe is below 0x20000: both encode it alike (ord(c) % n = ord(c)); the
    # student's last id, 0x20004, is past the teacher's 0x20000 ids and decodes to nothing there
    student = CharTokenizer(0x20005)
    with FakeVLLM(tokenizer=CharTokenizer(0x20000)) as fake:
        with pytest.raises(TeacherError) as e:
            ServedTeacher(fake.url).check(student)
    assert (f"token id {0x20004} decodes to '' there and to {chr(0x100 + 0x20004)!r} in the student's "
            f"({0x20005} tokens)") in one_line(e, fake.url)
