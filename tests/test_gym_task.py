"""reasoning-gym's tasks by name (gspo.tasks.gym): splits, options, the verifier's reward, the
prompts, and the one-line errors, as `gspo train --task reasoning_gym:NAME` meets them."""

import json

import pytest

pytest.importorskip("reasoning_gym")

from gspo.tasks import get_task  # noqa: E402
from gspo.tasks.gym import GymTask, TaskError, answer_format, extract_answer, parse_options, reasoning_gym_reward  # noqa: E402

SUMS = ("max_terms=2", "max_digits=2", "operators=[+]", "allow_negation=false", "allow_parentheses=false")


def scores(task, examples, completions):
    return reasoning_gym_reward(completions, [e.columns["entry"] for e in examples],
                                [e.columns["task_options"] for e in examples],
                                [e.columns["answer_from"] for e in examples])


def test_held_out_set_is_fixed_distinct_and_never_trained_on():
    a = get_task("reasoning_gym:basic_arithmetic", SUMS, 60)
    b = get_task("reasoning_gym:basic_arithmetic", SUMS, 60)
    test = [e.prompt for e in a.test_set()]
    assert test == [e.prompt for e in b.test_set()] and len(set(test)) == 60  # the same for every run, distinct
    # two-digit sums: 90*90 pairs at most, so training draws hit held-out problems and must skip them
    seen = [e.prompt for step in range(1, 41) for e in a.train_batch(step, 16, seed=3)]
    assert not set(seen) & set(test)
    # a function of (seed, step): a resumed run sees what an uninterrupted one saw; another seed, other problems
    assert [e.prompt for e in b.train_batch(7, 16, seed=3)] == seen[6 * 16:7 * 16]
    assert [e.prompt for e in a.train_batch(7, 16, seed=4)] != seen[6 * 16:7 * 16]
    # the options reach the generator: every problem is a sum of two numbers below 100
    for e in a.train_batch(1, 16, seed=0):
        x, y = e.columns["entry"]["metadata"]["expression"].split(" + ")
        assert 0 <= int(x) < 100 and 0 <= int(y) < 100 and e.answer == str(int(x) + int(y))


def test_no_held_out_set_with_eval_size_0_and_a_note_when_problems_run_short():
    none = get_task("reasoning_gym:basic_arithmetic", SUMS, 0)
    assert none.test_set() == [] and len(none.train_batch(1, 8)) == 8
    # one-digit sums: 10 x 10 pairs (and a few spellings of each), fewer than the 150 held-out problems asked for
    few = get_task("reasoning_gym:basic_arithmetic", ("max_terms=2", "max_digits=1", "operators=[+]",
                                                      "allow_negation=false", "allow_parentheses=false"), 150)
    assert (len(few.test_set()) < 150
            and f"only {len(few.test_set())} distinct held-out problems in 600 draws" in few.notes[0])


def test_the_reward_is_the_generators_verifier_with_its_partial_credit():
    task = get_task("reasoning_gym:basic_arithmetic", SUMS, 4)
    e = task.test_set(1)[0]
    gold = e.answer
    got = scores(task, [e] * 6, [f"<answer>{gold}</answer>", f"so <answer> {gold} </answer>",
                                 f"<answer>= {gold}</answer>", f"{gold}", f"I think\nit is {gold}\n",
                                 "<answer>1</answer><answer>" + gold + "</answer>"])
    # exact 1; spaces inside the tags stripped 1; "= 71" holds "71": reasoning-gym's len(gold)/len(answer);
    # no tags: the last line, "71" 1 and "it is 71" 2/8; two tagged answers: the last counts
    assert got == [1.0, 1.0, len(gold) / (len(gold) + 2), 1.0, len(gold) / (len(gold) + 6), 1.0]
    strict = get_task("reasoning_gym:basic_arithmetic", SUMS, 4, answer_from="tag_only").test_set(1)[0]
    assert scores(task, [strict] * 2, [f"{gold}", f"<answer>{gold}</answer>"]) == [0.0, 1.0]  # no tags: no answer


def test_answer_rules():
    assert extract_answer("a <answer>1</answer> b <answer>2</answer>") == "2"
    assert extract_answer("no tags", "tag_only") is None and extract_answer("no tags") == "no tags"
    assert extract_answer("", "last_line") is None and extract_answer("  \n") is None
    assert extract_answer("first\n\n  the end  \n\n", "last_line") == "the end"
    assert extract_answer("3 + 4 = 7, and 1,250 apples.", "last_number") == "1250"
    assert extract_answer("minus: -12", "last_number") == "-12" and extract_answer("none", "last_number") is None
    task = get_task("reasoning_gym:basic_arithmetic", SUMS, 4, answer_from="last_number")
    e = task.test_set(1)[0]
    assert scores(task, [e, e], [f"It is {e.answer}.", f"It is {int(e.answer) + 1}."]) == [1.0, 0.0]
    assert "number" in task.default_system_prompt and "<answer>" in GymTask.default_system_prompt


def test_answer_format_reward():
    assert answer_format(["think... <answer>12</answer>", "<answer>12</answer>\n", "<answer> </answer>",
                          "<answer>1</answer> more", "<answer>1</answer><answer>2</answer>", "12"]) == \
        [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_a_mix_with_weights_and_per_generator_options():
    task = get_task("reasoning_gym:chain_sum=3,leg_counting=1", ("chain_sum.max_terms=2", "max_animals=3"), 40)
    assert task.options == {"chain_sum": {"max_terms": 2}, "leg_counting": {"max_animals": 3}}
    drawn = [e.columns["entry"]["metadata"]["source_dataset"] for s in range(1, 11) for e in task.train_batch(s, 20)]
    share = drawn.count("chain_sum") / len(drawn)
    assert 0.65 < share < 0.85  # weight 3 of 4, over 200 draws (binomial sd 0.03)
    # each problem is scored by its own generator, with its own options
    mixed = task.test_set(10)
    assert scores(task, mixed, [f"<answer>{e.answer}</answer>" for e in mixed]) == [1.0] * 10
    assert json.loads(mixed[0].columns["task_options"]) in ({"max_terms": 2}, {"max_animals": 3})


@pytest.mark.parametrize("spec, options, message", [
    ("reasoning_gym:basic_arithmetc", (),
     r"reasoning-gym has no task 'basic_arithmetc'; did you mean basic_arithmetic\?"),
    ("reasoning_gym:", (), r"no generator named; e.g. --task reasoning_gym:basic_arithmetic"),
    ("reasoning_gym:chain_sum=0", (), r"weight of chain_sum must be > 0"),
    ("reasoning_gym:chain_sum=x", (), r"weight 'x' of chain_sum is not a number"),
    ("reasoning_gym:basic_arithmetic", ("max_term=2",), r"--task-option max_term: not an option of .*did you mean "
                                                        r"max_terms\? \(options: allow_negation, "),
    ("reasoning_gym:basic_arithmetic", ("max_terms",), r"--task-option 'max_terms': expected KEY=VALUE"),
    ("reasoning_gym:basic_arithmetic", ("seed=3",), r"seed is set by gspo"),
    ("reasoning_gym:basic_arithmetic", ("min_terms=5", "max_terms=2"),
     r"options min_terms=5, max_terms=2 refused by reasoning-gym \(AssertionError: max_terms must be >= min_terms\)"),
    ("reasoning_gym:chain_sum,leg_counting", ("leg_counting.max_terms=2",), r"not an option of leg_counting"),
    ("reasoning_gym:chain_sum", ("nope.max_terms=2",), r"'nope' is not a task of reasoning_gym:chain_sum"),
])
def test_bad_specs_and_options_are_one_line(spec, options, message):
    with pytest.raises(TaskError, match=message) as e:
        get_task(spec, options, 4)
    assert "\n" not in str(e.value)


def test_option_values_are_yaml_scalars():
    assert parse_options(("a=3", "b=0.5", "c=true", "d=[+, -]", "e=text", "f=")) == \
        {"a": 3, "b": 0.5, "c": True, "d": ["+", "-"], "e": "text", "f": ""}


def test_prompts_carry_the_format_and_plain_text_without_a_chat_template(char_tokenizer):
    from gspo.config import TrainConfig
    from gspo.sampling.samplers import Inputs, task_for
    from gspo.tasks.base import for_tokenizer, prompt_note
    from gspo.train.resolve import resolve

    cfg = resolve(TrainConfig(task="reasoning_gym:basic_arithmetic", task_options=SUMS, model="tiny", eval_size=4))
    task = task_for(cfg, Inputs())
    chat = task.test_set(1)[0].prompt
    assert chat[0] == {"role": "system", "content": GymTask.default_system_prompt} and chat[1]["role"] == "user"
    # the character tokenizer has no chat template: the instructions become plain text, and the run says so
    plain = for_tokenizer(task, char_tokenizer)
    question = task.task.test_set(1)[0].prompt
    assert plain.test_set(1)[0].prompt == f"{GymTask.default_system_prompt}\n\n{question}\n"
    assert "plain text" in prompt_note(plain, "m")[0] and prompt_note(task, "m") == []
    # the user's own --system-prompt replaces the task's, and is never turned into plain text
    mine = task_for(resolve(TrainConfig(task="reasoning_gym:basic_arithmetic", system_prompt="Be brief.", model="tiny",
                                        eval_size=4)), Inputs())
    assert mine.test_set(1)[0].prompt[0]["content"] == "Be brief." and for_tokenizer(mine, char_tokenizer) is mine


def test_yaml_and_python_take_a_mapping_of_options(tmp_path):
    from gspo.config import TrainConfig
    from gspo.config.yamlfile import load_yaml
    from gspo.train.resolve import resolve

    (tmp_path / "run.yaml").write_text("task: reasoning_gym:basic_arithmetic\ntask_options:\n  max_terms: 2\n"
                                       "  operators: ['+', '-']\n  format_style: simple\nmodel: tiny\n")
    from_yaml = resolve(load_yaml(tmp_path / "run.yaml"))
    from_python = resolve(TrainConfig(task="reasoning_gym:basic_arithmetic", model="tiny",
                                      task_options={"max_terms": 2, "operators": ["+", "-"], "format_style": "simple"}))
    assert from_yaml.data.task_options == from_python.data.task_options
    assert parse_options(from_python.data.task_options) == {"max_terms": 2, "operators": ["+", "-"],
                                                              "format_style": "simple"}


@pytest.mark.parametrize("args, message", [
    (["--task", "reasoning_gym:leg_countin", "--model", "tiny"],
     "reasoning-gym has no task 'leg_countin'; did you mean leg_counting?"),
    (["--task", "reasoning_gym:leg_counting"], "--task reasoning_gym:leg_counting needs --model"),
    (["--task-option", "max_terms=2"],
     "--task-options max_terms=2: applies to a reasoning_gym:NAME or verifiers:TASKSET_ID task"),
    (["--task", "reasoning_gym:leg_counting", "--model", "tiny", "--task-option", "max_animals=two"],
     "refused by reasoning-gym"),
])
def test_the_cli_says_one_line_and_writes_nothing(args, message, tmp_path, capsys):
    from gspo.cli import main

    run = tmp_path / "run"
    assert main(["train", *args, "--steps", "1", "--output-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gspo train: error: ") and message in err[0], err
    assert not run.exists()


def test_gspo_tasks_lists_names_and_shows_options(capsys):
    from gspo.cli import main

    assert main(["tasks"]) == 0
    out = capsys.readouterr().out
    assert "arithmetic" in out and "basic_arithmetic, bf," in out and "leg_counting" in out
    assert main(["tasks", "reasoning_gym:leg_counting"]) == 0
    out = capsys.readouterr().out
    assert "max_animals = 10" in out and "its answer: " in out


def test_gspo_eval_takes_a_reasoning_gym_task_and_its_options(capsys):
    # the built-in tiny model reads no letters, but the command runs as a user's would: the task by name,
    # its options, the answer rule; the character tokenizer has no chat template, so prompts are plain text
    from gspo.cli import main

    assert main(["eval", "--model", "tiny", "--task", "reasoning_gym:chain_sum", "--task-option", "max_terms=2",
                 "--answer-from", "last_number", "--eval-size", "3", "--k", "0", "--max-new-tokens", "4",
                 "--no-progress", "--threads", "1"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["task"] == "reasoning_gym:chain_sum" and result["n"] == 3 and result["metric"] == "reasoning_gym"


@pytest.mark.slow
def test_gspo_compare_takes_a_reasoning_gym_task(tmp_path):
    from tests.test_cli import gspo

    out = tmp_path / "cmp"
    r = gspo("compare", "--configs", "gspo", "grpo", "--seeds", "0", "--steps", "1", "--model", "tiny",
             "--task", "reasoning_gym:chain_sum", "--task-option", "max_terms=2", "--answer-from", "last_number",
             "--max-new-tokens", "4", "--max-prompt-length", "56", "--eval-size", "4", "--prompts-per-step", "2",
             "--group-size", "2", "--no-progress", "--output-dir", str(out))  # tiny: 64 positions
    assert r.returncode == 0, r.stderr
    report = (out / "report.md").read_text()
    assert "task `reasoning_gym:chain_sum`" in report
    for name in ("gspo", "grpo"):
        config = (out / "runs" / f"{name}-seed0" / "config.yaml").read_text()
        assert "task: reasoning_gym:chain_sum" in config and "max_terms=2" in config


def test_gspo_eval_keeps_every_repeated_flag():
    # `gspo eval --task-option a=1 --task-option b=2` (and --reward twice): every value, not the last one only
    from gspo.commands.argv import list_flags, merge_repeated, parse
    from gspo.commands.eval import EvalArgs

    args = ["--model", "tiny", "--task-option", "a=1", "--task-option", "b=2", "--reward", "x", "--reward", "y"]
    a = parse(EvalArgs, merge_repeated(args, list_flags(EvalArgs)), "gspo eval")
    assert a.task_options == ("a=1", "b=2") and a.reward == ("x", "y")
