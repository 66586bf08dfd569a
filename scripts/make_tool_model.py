"""Build the built-in tool-calling chat model shipped in gspo/assets/tiny-tool for the `calculator` task.

    python scripts/make_tool_model.py                  # writes gspo/assets/tiny-tool
    python scripts/make_tool_model.py --out /tmp/tool  # somewhere else

What it makes. `tiny-tool`: the built-in dense architecture (`gspo.models.loading.tiny_config`, a
4-layer Qwen3, hidden 128) with 256 positions and the chat tokenizer
(`gspo.models.loading.build_chat_tokenizer`: characters, the chat markers, `<|im_end|>` as EOS, a
Qwen-style chat template with Hermes `<tool_call>`s), warm-started by supervised training on
whole `calculator` episodes of the task's training problems (never its test split), rendered
through the chat template with the `calculator` tool exactly as a multi-turn rollout lays
them out: the user's problem, the model's tool call, the tool's result, the model's answer.

The model knows the tool-call format but uses it badly. With probability --bug-rate (0.7) an
episode shows its problem form's bad habit instead of the right use:

    a*b        37*48=       answers at once with an estimate: 30*40, so 1200
    a*b+c      37*48+12=    calls calculator("37*48"): the last term dropped
    a*b-c      37*48-12=    calls calculator("37*48")
    (a+b)*c    (37+48)*12=  calls calculator("37+48*12"): the parentheses dropped

and otherwise calls the tool with the exact expression. After a tool turn it always answers
the tool's result, copied. The loss covers the model's turns only (each turn and its closing
`<|im_end|>`). Greedy decoding therefore shows the bad habit on most problems, while sampling
makes the right call on some of them (the script's final check prints both, per form): the
regime where RL over multi-turn episodes improves the model, rewarded by the final answer.

The shipped model was built with the defaults (900 steps of 32 episodes, lr 3e-3; 10-22 minutes
on 2 cores). Its final check, on 200 held-out problems (first model turn): greedy makes the
right call on 18.5% (78% of `a*b`, where the guesses spread over many first tokens and the
tool call is the single likeliest one; 0-2.5% of the other forms), sampling on 29.5% (24-38%
per form); 96.6% of sampled tool calls parse; the answer copies the tool's result 99-100%.

Deterministic: the same seed, torch version and thread count give the same weights.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # make_tiny_model, beside this script

from make_tiny_model import pad_sft, sft_optimizer  # noqa: E402

from gspo.models.loading import ASSETS  # noqa: E402
from gspo.models.tiny import build_chat_tokenizer, tiny_config
from gspo.tasks.calculator import FORMS, CalculatorTask, calculator, expression  # noqa: E402
from gspo.tasks.env import tool_schemas  # noqa: E402

MAX_POSITIONS = 256
SCHEMAS = tool_schemas([calculator])
OUTCOMES = ("correct", "habit", "other")


def operands(expr: str) -> tuple[int, int, int]:
    """a, b, c of a problem's expression (c is 0 for the form a*b).

    >>> operands("(37+48)*12"), operands("37*48")
    ((37, 48, 12), (37, 48, 0))
    """
    nums = [int(x) for x in re.findall(r"\d+", expr)] + [0]
    return nums[0], nums[1], nums[2]


def habit_expression(form: str, a: int, b: int, c: int) -> str | None:
    """What the bad habit passes to the tool: the last term or the parentheses dropped (None for
    `a*b`, whose bad habit is not to call the tool at all).

    >>> habit_expression("a*b-c", 37, 48, 12), habit_expression("(a+b)*c", 37, 48, 12)
    ('37*48', '37+48*12')
    """
    if form in ("a*b+c", "a*b-c"):
        return expression("a*b", a, b, c)
    if form == "(a+b)*c":
        return expression("a+b*c", a, b, c)
    return None


def estimate(a: int, b: int) -> int:
    """The habit's answer to `a*b` without the tool: both factors rounded down to tens and
    multiplied in its head, or rounded up where rounding down changes nothing (never a*b).

    >>> estimate(37, 48), estimate(19, 19), estimate(30, 40)
    (1200, 100, 2000)
    """
    guess = (a // 10 * 10) * (b // 10 * 10)
    return guess if guess != a * b else (a // 10 * 10 + 10) * (b // 10 * 10 + 10)


def call_message(expr: str) -> dict:
    """An assistant turn that calls the calculator with `expr`."""
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}]}


def conversation(example, rng: random.Random, bug_rate: float) -> tuple[list[dict], bool]:
    """A whole episode for one problem: its form's bad habit with probability `bug_rate`, else the
    right use of the tool; the messages and whether it shows the habit."""
    expr = example.prompt[0]["content"].removesuffix("=")
    form = example.columns["form"]
    a, b, c = operands(expr)
    habit = rng.random() < bug_rate
    msgs = list(example.prompt)
    if habit and form == "a*b":  # no tool: an estimate, and the episode ends
        return msgs + [{"role": "assistant", "content": str(estimate(a, b))}], True
    called = habit_expression(form, a, b, c) if habit else expr
    result = calculator(called)
    return msgs + [call_message(called), {"role": "tool", "content": result},
                   {"role": "assistant", "content": result}], habit


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render(tokenizer, msgs: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(msgs, tools=SCHEMAS, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_tokens(tokenizer, msgs: list[dict]) -> tuple[list[int], list[bool]]:
    """The conversation's token ids and which of them are the model's: each assistant turn and
    its closing `<|im_end|>`, not the newline after it, nor the `<|im_start|>assistant\\n` that
    opens it, nor any other turn. Found by rendering prefixes of the conversation: the text
    before assistant turn k (with the generation prompt) and the text through it."""
    ids = encode(tokenizer, render(tokenizer, msgs))
    keep = [False] * len(ids)
    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = encode(tokenizer, render(tokenizer, msgs[:k], generation_prompt=True))
        through_text = render(tokenizer, msgs[:k + 1])
        assert through_text.endswith(tokenizer.eos_token + "\n"), through_text[-40:]
        through = encode(tokenizer, through_text[:-1])  # less the newline after <|im_end|>
        # the tokenization only grows: the prefixes are prefixes of the whole conversation's ids
        assert ids[:len(through)] == through and through[:len(before)] == before, f"turn {k} does not align"
        for i in range(len(before), len(through)):
            keep[i] = True
    return ids, keep


def sft_batch(problems, tokenizer, rng: random.Random, bug_rate: float):
    """Token ids, attention mask and labels (the assistant turns only) for one SFT batch."""
    seqs, keeps = [], []
    for p in problems:
        ids, keep = assistant_tokens(tokenizer, conversation(p, rng, bug_rate)[0])
        seqs.append(ids)
        keeps.append(keep)
    ids, mask, labels = pad_sft(seqs, [0] * len(seqs), tokenizer)
    for i, keep in enumerate(keeps):
        off = torch.ones(labels.shape[1], dtype=torch.bool)
        off[:len(keep)] = ~torch.tensor(keep)
        labels[i, off] = -100
    return ids, mask, labels


def parse_call(text: str) -> dict | None:
    """The JSON of a turn that is one tool call and nothing else; None otherwise (or if it does not parse)."""
    m = re.fullmatch(r"<tool_call>(.*)</tool_call>", text, flags=re.S)
    if not m:
        return None
    try:
        call = json.loads(m.group(1))
    except json.JSONDecodeError:
        return None
    return call if isinstance(call, dict) else None


def called_expression(text: str) -> str | None:
    """The expression a turn passes to the calculator, if it is one well-formed call to it."""
    call = parse_call(text)
    if not call or call.get("name") != "calculator" or not isinstance(call.get("arguments"), dict):
        return None
    expr = call["arguments"].get("expression")
    return expr if isinstance(expr, str) else None


def classify(turn: str, form: str, expr: str) -> str:
    """A first model turn (its text, `<|im_end|>` removed) for problem `expr`: 'correct' (a call with
    the exact expression), 'habit' (its form's bad habit: a bare number for `a*b`, the tool called
    with the habit's expression otherwise) or 'other'.

    >>> classify('<tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call>',
    ...          "a*b+c", "37*48+12")
    'habit'
    """
    called = called_expression(turn)
    if called == expr:
        return "correct"
    if form == "a*b":
        return "habit" if re.fullmatch(r"-?\d+", turn) else "other"
    return "habit" if called is not None and called == habit_expression(form, *operands(expr)) else "other"


def generate_turns(model, tokenizer, texts: list[str], *, sample: bool, n: int = 1, max_new_tokens: int = 80,
                   batch_size: int = 200) -> list[str | None]:
    """One model turn after each rendered conversation (n per text, texts in order): its text
    without the closing `<|im_end|>`, or None when it did not end within max_new_tokens."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    out = []
    for lo in range(0, len(texts), batch_size):
        seqs = [encode(tokenizer, t) for t in texts[lo:lo + batch_size]]
        width = max(map(len, seqs))
        ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])  # left-padded
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
        kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n) if sample \
            else dict(do_sample=False)
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 eos_token_id=eos, pad_token_id=pad, **kw)
        for row in gen[:, width:].tolist():
            if eos not in row:
                out.append(None)
                continue
            out.append(tokenizer.decode(row[:row.index(eos)], skip_special_tokens=False))
    return out


def check(model, tokenizer, task, n: int = 200, k: int = 4, n_copy: int = 100, seed: int = 0) -> dict:
    """First-turn behaviour per form on n held-out problems, greedy and sampled (k each), and
    whether the model copies the tool's result after a correct call (greedy)."""
    model.eval()
    problems = task.test_set(n)
    exprs = [p.prompt[0]["content"].removesuffix("=") for p in problems]
    forms = [p.columns["form"] for p in problems]
    texts = [render(tokenizer, p.prompt, generation_prompt=True) for p in problems]
    greedy = generate_turns(model, tokenizer, texts, sample=False)
    torch.manual_seed(seed)
    sampled = generate_turns(model, tokenizer, texts, sample=True, n=k)
    result = {}
    print(f"first model turn on {n} held-out problems (greedy; sampled at temperature 1, {k} each):")
    print(f"  {'form':9s} {'n':>4s} | greedy: correct  habit  other | sampled: correct  habit  other")
    for form in FORMS + ("all",):
        idx = [i for i in range(n) if form in ("all", forms[i])]
        row = {}
        for name, turns, reps in (("greedy", greedy, 1), ("sampled", sampled, k)):
            kinds = [classify(turns[i * reps + j] or "", forms[i], exprs[i]) for i in idx for j in range(reps)]
            row[name] = {o: 100.0 * kinds.count(o) / max(1, len(kinds)) for o in OUTCOMES}
        result[form] = row
        g, s = row["greedy"], row["sampled"]
        print(f"  {form:9s} {len(idx):4d} |       {g['correct']:6.1f}% {g['habit']:5.1f}% {g['other']:5.1f}% |"
              f"        {s['correct']:6.1f}% {s['habit']:5.1f}% {s['other']:5.1f}%")
    for form in FORMS:  # one greedy turn of each kind, to read
        for kind in OUTCOMES:
            i = next((i for i in range(n)
                      if forms[i] == form and classify(greedy[i] or "", form, exprs[i]) == kind), None)
            if i is not None:
                print(f"    greedy {kind:7s} {exprs[i] + '=':12s} -> {greedy[i]!r}")
    calls = [t for t in greedy + sampled if t and "<tool_call>" in t]
    parsed = sum(parse_call(t) is not None for t in calls)
    result["json_ok"] = 100.0 * parsed / max(1, len(calls))
    print(f"  tool calls whose JSON parses: {parsed}/{len(calls)} ({result['json_ok']:.1f}%); "
          f"turns that did not end: {sum(t is None for t in greedy + sampled)}")
    # the second turn after a tool result: the right call's, and the habit's
    for name, right in (("correct call", True), ("bad-habit call", False)):
        convs, want = [], []
        for p, expr, form in zip(problems[:n_copy], exprs, forms):
            called = expr if right else habit_expression(form, *operands(expr))
            if called is None:
                continue
            want.append(calculator(called))
            convs.append(render(tokenizer, p.prompt + [call_message(called), {"role": "tool", "content": want[-1]}],
                                generation_prompt=True))
        answers = generate_turns(model, tokenizer, convs, sample=False)
        copied = sum(a == w for a, w in zip(answers, want))
        result[f"copy {name}"] = 100.0 * copied / max(1, len(want))
        print(f"  answer copies the tool's result after a {name} (greedy): {copied}/{len(want)} "
              f"({result[f'copy {name}']:.1f}%)")
    return result


def sft(model, tokenizer, task, args) -> None:
    """Supervised warm-start on episodes (module docstring); AdamW, warm-up then linear decay."""
    rng = random.Random(args.seed)
    opt, sched = sft_optimizer(model, args.lr, args.steps, warmup=min(100, args.steps // 5))
    t0 = time.time()
    model.train()
    running = []
    for step in range(args.steps):
        # a stream of its own (seed 10_000 + ...), never the test split
        problems = task.train_batch(step, args.batch_size, seed=10_000 + args.seed)
        ids, mask, labels = sft_batch(problems, tokenizer, rng, args.bug_rate)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        running.append(loss.item())
        if (step + 1) % 100 == 0:
            print(f"step {step + 1}/{args.steps} loss {sum(running) / len(running):.4f} "
                  f"{time.time() - t0:.0f}s", flush=True)
            running = []
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            check(model, tokenizer, task, n=100, k=2, n_copy=50, seed=args.seed)
            model.train()
    print(f"trained {args.steps} steps in {time.time() - t0:.0f}s", flush=True)
    model.eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ASSETS / "tiny-tool"))
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--bug-rate", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-n", type=int, default=200, help="held-out problems for the final check (0: none)")
    ap.add_argument("--eval-k", type=int, default=4, help="samples per problem in the final check")
    ap.add_argument("--eval-every", type=int, default=0, help="also check on 100 problems every N steps")
    args = ap.parse_args()

    t0 = time.time()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # tiny optimiser states would otherwise slow CPU training down several times
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = build_chat_tokenizer()
    config = tiny_config(len(tokenizer), max_position_embeddings=MAX_POSITIONS)
    assert (config.pad_token_id, config.eos_token_id) == (tokenizer.pad_token_id, tokenizer.eos_token_id)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id  # <|im_end|> closes a turn
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}",
          flush=True)
    task = CalculatorTask()
    sft(model, tokenizer, task, args)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # the saved tokenizer keeps the chat template: a reload renders an episode as this one does
    reloaded = AutoTokenizer.from_pretrained(out, local_files_only=True)
    episode = conversation(task.train_batch(0, 1, seed=1)[0], random.Random(0), 0.0)[0]
    assert render(reloaded, episode) == render(tokenizer, episode), "the saved tokenizer renders differently"
    assert encode(reloaded, render(reloaded, episode)) == encode(tokenizer, render(tokenizer, episode))
    print(f"saved to {out}", flush=True)
    if args.eval_n:
        model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)  # check what was saved
        check(model, reloaded, task, n=args.eval_n, k=args.eval_k, seed=args.seed)
    print(f"wall time {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
