"""The `chain` task (long answers): deterministic, disjoint splits; correct problems; the
reward that checks only the final number; the built-in models that fit its answers."""

import pytest

from gspo.models.loading import load_policy
from gspo.rewards.builtin import load_rewards
from gspo.tasks import get_task
from gspo.tasks.chain import START, STEP, TARGET, chain_answer, last_number, length_bin, parse_prompt, reference_steps


@pytest.fixture(scope="module")
def task():
    return get_task("chain")


def test_splits_are_deterministic_and_disjoint(task):
    other = get_task("chain")
    assert task.test_set() == other.test_set()
    assert len(task.test_set()) == 500
    test_prompts = {p.prompt for p in task.test_set()}
    assert len(test_prompts) == len(task.test_set())
    for step in range(1, 30):
        batch = task.train_batch(step, 64, seed=3)
        assert batch == other.train_batch(step, 64, seed=3)  # a function of (seed, step) alone
        assert not test_prompts & {p.prompt for p in batch}
    assert task.train_batch(1, 64, seed=3) != task.train_batch(2, 64, seed=3)
    assert task.train_batch(1, 64, seed=3) != task.train_batch(1, 64, seed=4)


def test_problems_are_correct(task):
    steps_seen = set()
    for p in task.test_set() + task.train_batch(0, 500):
        a, d = parse_prompt(p.prompt)
        assert p.prompt == f"{a}(+{d})=" and START[0] <= a <= START[1] and STEP[0] <= d <= STEP[1]
        total, n = a, 0
        while total < TARGET:  # counting up by hand
            total, n = total + d, n + 1
        assert p.answer == p.columns["answer"] == str(total) and p.columns["n_steps"] == n
        assert TARGET <= total < TARGET + d
        steps_seen.add(n)
    assert min(steps_seen) == 5 and max(steps_seen) >= 18  # (1000 - 599) / 99 -> 5 steps; (1000 - 10) / 50 -> 20


def test_reference_steps_parse_and_score(task):
    for p in task.test_set()[:100]:
        a, d = parse_prompt(p.prompt)
        steps = reference_steps(a, d).split(" ")
        assert len(steps) == p.columns["n_steps"]
        total = a
        for step in steps:
            lhs, rhs = step.split("=")
            x, y = map(int, lhs.split("+"))
            assert (x, y, int(rhs)) == (total, d, total + d)
            total += d
        assert last_number(" ".join(steps)) == int(p.answer)
    reward = load_rewards(list(task.default_rewards), None)[0]
    assert reward.name == "chain_answer"
    ex = task.test_set()[0]
    good = reference_steps(*parse_prompt(ex.prompt))
    assert reward.fn([good, good + "0"], answer=[ex.answer] * 2, n_steps=[ex.columns["n_steps"]] * 2) == [1.0, 0.0]


@pytest.mark.parametrize("completion,answer,reward", [
    # 840(+65)= (total 1035)
    ("840+65=905 905+65=970 970+65=1035", "1035", 1.0),  # the reference chain
    ("840+65=905 905+65=970 970+65=1035 ", "1035", 1.0),  # trailing space
    ("840+65=895 895+65=960 960+65=1025", "1035", 0.0),  # 840+65 added wrong: off by 10 to the end
    ("840+65=905 905+65=960 960+65=1025", "1035", 0.0),  # forgot the carry at 905+65 (5+5=10): off by 10
    ("840+65=905 905+65=960 960+65=1035", "1035", 1.0),  # wrong steps, right last number: the steps are free
    ("1035", "1035", 1.0),  # the total alone
    ("840+65=905 905+65=970 970+65=", "1035", 0.0),  # cut off before the last sum: last number is 65
    ("840+65=905 905+65=970 970+65=10350", "1035", 0.0),
    ("840+65=905 905+65=970 970+65=01035", "1035", 1.0),  # numbers compare as integers
    ("", "1035", 0.0),
    ("+ = ", "1035", 0.0),
])
def test_chain_answer_reward(completion, answer, reward):
    assert chain_answer([completion], answer=[answer]) == [reward]


def test_answers_are_long(task):
    lengths = [len(reference_steps(*parse_prompt(p.prompt))) for p in task.test_set()]
    assert min(lengths) >= 50 and max(lengths) >= 200
    assert task.default_max_new_tokens >= max(lengths) + 1  # + EOS
    assert {length_bin(p.columns["n_steps"]) for p in task.test_set()} == {"5-6", "7-8", "9-11", "12-20"}


@pytest.mark.parametrize("name", ["tiny-long", "tiny-long-moe"])
def test_builtin_long_models_fit_the_task(task, name):
    model, tokenizer = load_policy(name)
    longest = max(task.test_set(), key=lambda p: len(p.prompt))
    prompt = tokenizer(longest.prompt)["input_ids"]
    assert tokenizer.unk_token_id not in prompt
    assert tokenizer.decode(prompt) == longest.prompt
    assert model.config.max_position_embeddings >= len(prompt) + task.default_max_new_tokens
    answer = tokenizer(reference_steps(*parse_prompt(longest.prompt)))["input_ids"]
    assert tokenizer.unk_token_id not in answer
    if name.endswith("moe"):
        assert model.config.num_experts == 8 and model.config.num_experts_per_tok == 2
