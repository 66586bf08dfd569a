"""scripts/make_tool_model.py: the episodes it trains on (each form's bad habit, the right use of
the tool), the loss on the model's turns only, and the classification of a first model turn."""

import importlib.util
import json
import random
from pathlib import Path

import torch

from gspo.models.tiny import build_chat_tokenizer
from gspo.tasks.calculator import CalculatorTask, evaluate_expression

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_tool_model.py"
spec = importlib.util.spec_from_file_location("make_tool_model", SCRIPT)
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)

CALL = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{}"}}}}</tool_call>'


def _problems(n=200):
    return CalculatorTask().train_batch(0, n, seed=10_000)


def _call(msg):
    return msg["tool_calls"][0]["function"]["arguments"]["expression"]


def test_correct_episodes_call_the_tool_with_the_exact_expression_and_copy_its_result():
    rng = random.Random(0)
    for p in _problems():
        msgs, habit = script.conversation(p, rng, 0.0)
        assert not habit
        user, call, tool, answer = msgs
        assert user == p.prompt[0] and _call(call) + "=" == user["content"]
        assert tool == {"role": "tool", "content": p.answer}
        assert answer == {"role": "assistant", "content": p.answer}


def test_bad_habits_per_form():
    rng = random.Random(0)
    seen = set()
    for p in _problems():
        msgs, habit = script.conversation(p, rng, 1.0)
        assert habit
        form, expr = p.columns["form"], p.prompt[0]["content"].removesuffix("=")
        a, b, c = script.operands(expr)
        seen.add(form)
        if form == "a*b":  # an estimate in its head, no tool: 37*48 -> 30*40
            (_, answer) = msgs
            assert answer["role"] == "assistant" and "tool_calls" not in answer
            assert answer["content"] != p.answer
            ta, tb = a // 10 * 10, b // 10 * 10
            assert int(answer["content"]) == (ta * tb if (ta, tb) != (a, b) else (ta + 10) * (tb + 10))
            continue
        _, call, tool, answer = msgs
        want = f"{a}*{b}" if form in ("a*b+c", "a*b-c") else f"{a}+{b}*{c}"
        assert _call(call) == want  # the last term, or the parentheses, dropped
        assert tool["content"] == answer["content"] == str(evaluate_expression(want))
        assert answer["content"] != p.answer
    assert seen == {"a*b", "a*b+c", "a*b-c", "(a+b)*c"}


def test_bug_rate_is_the_share_of_habits():
    rng = random.Random(1)
    habits = [script.conversation(p, rng, 0.7)[1] for p in _problems(400)]
    assert 0.6 < sum(habits) / len(habits) < 0.8


def test_labels_cover_exactly_the_assistant_turns_and_their_im_end():
    tok = build_chat_tokenizer()
    p = _problems(1)[0]  # 74*24+35=
    msgs, _ = script.conversation(p, random.Random(0), 0.0)
    ids, keep = script.assistant_tokens(tok, msgs)
    text = tok.apply_chat_template(msgs, tools=script.SCHEMAS, tokenize=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    labelled = tok.decode([i for i, k in zip(ids, keep) if k], skip_special_tokens=False)
    assert labelled == CALL.format("74*24+35") + "<|im_end|>" + "1811<|im_end|>"
    # the labelled stretches are whole turns: each begins right after `<|im_start|>assistant\n`
    # and ends on `<|im_end|>`, the newline after it unlabelled
    starts = [i for i in range(len(ids)) if keep[i] and not keep[i - 1]]
    ends = [i for i in range(len(ids)) if keep[i] and (i + 1 == len(ids) or not keep[i + 1])]
    assert len(starts) == len(ends) == 2
    for s, e in zip(starts, ends):
        assert tok.decode(ids[:s], skip_special_tokens=False).endswith("<|im_start|>assistant\n")
        assert ids[e] == tok.eos_token_id and tok.decode([ids[e + 1]]) == "\n"


def test_sft_batch_labels_match_assistant_tokens():
    tok = build_chat_tokenizer()
    problems = _problems(8)
    ids, mask, labels = script.sft_batch(problems, tok, random.Random(3), 0.7)
    rng = random.Random(3)
    for i, p in enumerate(problems):
        seq, keep = script.assistant_tokens(tok, script.conversation(p, rng, 0.7)[0])
        assert ids[i, :len(seq)].tolist() == seq and int(mask[i].sum()) == len(seq)
        want = torch.full((ids.shape[1],), -100)
        want[:len(seq)] = torch.where(torch.tensor(keep), torch.tensor(seq), torch.tensor(-100))
        assert torch.equal(labels[i], want)


def test_classify_a_first_turn():
    c = script.classify
    assert c(CALL.format("37*48+12"), "a*b+c", "37*48+12") == "correct"
    assert c(CALL.format("37*48"), "a*b+c", "37*48+12") == "habit"
    assert c(CALL.format("37*48"), "a*b-c", "37*48-12") == "habit"
    assert c(CALL.format("37+48*12"), "(a+b)*c", "(37+48)*12") == "habit"
    assert c(CALL.format("37*48"), "a*b", "37*48") == "correct"
    assert c("1776", "a*b", "37*48") == "habit"
    assert c("1776", "a*b+c", "37*48+12") == "other"  # answering at once is a*b's habit only
    assert c(CALL.format("37*49"), "a*b+c", "37*48+12") == "other"
    assert c(CALL.format("37*48+12")[:-3], "a*b+c", "37*48+12") == "other"  # unclosed
    assert c('<tool_call>{"name": "calculator", "arguments": {"expression": "37*48+12"}</tool_call>',
             "a*b+c", "37*48+12") == "other"  # the JSON does not parse
    assert script.parse_call(CALL.format("1+2")) == json.loads(CALL.format("1+2")[11:-12])
