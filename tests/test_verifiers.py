"""verifiers environments (gspo.agents.vfenv): verifiers 0.4's own Env, taskset, harness and rewards
play gspo's episodes through the endpoint over the policy.

The tasksets are in tests/vf_tasksets, built from verifiers' classes as their authors write them:
single-turn (gspo_vf_say: say the word), multi-turn (gspo_vf_chat: a scripted user's second turn)
and tools (gspo_vf_tools: an MCP tool server, `calc_add`). Each episode runs verifiers' `null`
harness (its chat program, in a local subprocess made by uv) against the endpoint; the first one
on a machine lets verifiers install uv and the program's packages from the registry. Offline is
every proxy variable pointing at a closed port (loopback exempt); a failing setup is verifiers'
subprocess runtime failing to prepare the program, as uv does without the index.
"""

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verifiers.v1")

from gspo.agents import vfenv  # noqa: E402
from gspo.agents.runner import run_agent_episodes  # noqa: E402
from gspo.agents.vfenv import KEY_VAR, TASK_COLUMN, VerifiersTask, endpoint_key  # noqa: E402
from gspo.models.loading import load_policy  # noqa: E402
from gspo.sampling.episodes import Draws, EpisodeSpec  # noqa: E402
from gspo.sampling.rollout import PolicySampler, sampling_params  # noqa: E402
from gspo.tasks.env import EnvError  # noqa: E402

# every test starts a process: verifiers prepares its runtime with uv on a taskset's first load, and its harness
# and tool servers run in processes of their own
pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[1]
TASKSETS = Path(__file__).parent / "vf_tasksets"


@pytest.fixture(autouse=True)
def tasksets_importable(monkeypatch):
    """verifiers imports a taskset by id, here and in the tool server's own process."""
    monkeypatch.syspath_prepend(str(TASKSETS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TASKSETS), os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_policy("tiny-tool")


class Scripted:
    """A sampler that writes `reply(prompt_text)` for each prompt, its log-probs -0.5."""

    def __init__(self, tok, reply):
        self.tok, self.reply, self.end = tok, reply, tok.convert_tokens_to_ids("<|im_end|>")

    def sample(self, prompts, params, generator=None, rows=None):  # the Sampler interface (no randomness)
        outs = [self.tok(self.reply(self.tok.decode(p)), add_special_tokens=False)["input_ids"] + [self.end]
                for p in prompts]
        n = max(map(len, outs))
        ids = torch.full((len(outs), n), self.end)
        for j, o in enumerate(outs):
            ids[j, :len(o)] = torch.tensor(o)
        return SimpleNamespace(completion_ids=ids, logp=torch.full((len(outs), n), -0.5),
                               lengths=torch.tensor([len(o) for o in outs]),
                               truncated=torch.zeros(len(outs), dtype=torch.bool))


def play(tiny, task, sampler, G=2, max_new_tokens=40, timeout=120.0):
    _, tok = tiny
    params = sampling_params(tok, stop=(tok.convert_tokens_to_ids("<|im_end|>"),), group_size=G,
                             max_new_tokens=max_new_tokens)
    spec = EpisodeSpec(task.default_env, max_turns=4, timeout=timeout)
    return run_agent_episodes(sampler, tok, task.test_set(), spec, params, Draws())


def row(ro, b):
    n = int(ro.lengths[b])
    return ro.prompt_ids[b][ro.prompt_mask[b].bool()].tolist(), ro.completion_ids[b, :n].tolist(), n


def test_a_single_turn_environment_scores_with_its_own_reward(tiny):
    _, tok = tiny
    task = VerifiersTask.from_spec("verifiers:gspo-vf-say", {"count": 4}, test_size=2)
    assert [ex.prompt for ex in task.test_set()] == [[{"role": "user", "content": "say ok"}],
                                                    [{"role": "user", "content": "say no"}]]
    ro, ep = play(tiny, task, Scripted(tok, lambda prompt: "ok"))
    # the reward is the taskset's `exact`: "ok" is right for "say ok" (episodes 0, 1), wrong for "say no"
    assert ep.turn_rewards == [[1.0], [1.0], [0.0], [0.0]]
    assert ep.failed.tolist() == [False] * 4 and ep.turns.tolist() == [1] * 4
    prompt, completion, n = row(ro, 0)
    want = tok.apply_chat_template([{"role": "user", "content": "say ok"}], add_generation_prompt=True, tokenize=False)
    assert prompt == tok(want, add_special_tokens=False)["input_ids"]  # the harness's messages, rendered by gspo
    assert completion == tok("ok", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert ro.completion_mask[0, :n].tolist() == [1.0] * n and ro.logp[0, :n].tolist() == [-0.5] * n
    assert not [k for k in os.environ if k.startswith(KEY_VAR)]  # the run's key left with its episodes


def test_a_multi_turn_environment_is_one_sequence_token_for_token(tiny):
    model, tok = tiny
    task = VerifiersTask.from_spec("verifiers:gspo-vf-chat", {}, test_size=2)
    ro, ep = play(tiny, task, PolicySampler(model), max_new_tokens=6)
    assert ep.failed.tolist() == [False] * 4 and ep.turns.tolist() == [2] * 4
    assert ep.agent.extra_sequences.tolist() == [0] * 4  # the second call extends the first: one sequence
    for b in range(4):
        prompt, completion, n = row(ro, b)
        text = tok.decode(completion)
        answer = ["ok", "no"][b // 2]
        assert f"<|im_start|>user\nnow say {answer}<|im_end|>" in text  # the scripted user's turn, between
        env = ro.env_mask[b, :n].bool()
        assert f"now say {answer}" in tok.decode(torch.tensor(completion)[env])
        assert not (env & ro.completion_mask[b, :n].bool()).any()  # the user's tokens are never trained
        last_reply = tok.decode(completion[int(env.nonzero().max()) + 1:], skip_special_tokens=True)
        assert ep.turn_rewards[b] == [float(answer in last_reply)]  # the taskset's `said`, on the last reply
        # the recorded log-probs are the policy's: a teacher-forced forward over the row gives them back
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits.float().log_softmax(-1)[0, len(prompt) - 1:-1]
        forward = logits.gather(-1, torch.tensor(completion)[:, None])[:, 0]
        on = ro.completion_mask[b, :n].bool()
        assert forward[on].tolist() == pytest.approx(ro.logp[b, :n][on].tolist(), abs=1e-4)


def test_a_tool_environment_runs_its_tool_server_and_masks_the_results(tiny):
    _, tok = tiny

    def reply(prompt):  # call the tool first; once its result is back, answer with it
        if "<tool_response>" not in prompt:
            return '<tool_call>\n{"name": "calc_add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        return prompt.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0]

    task = VerifiersTask.from_spec("verifiers:gspo-vf-tools", {}, test_size=2)
    ro, ep = play(tiny, task, Scripted(tok, reply), max_new_tokens=80)  # the call is 70 tokens of this tokenizer
    # the tasks are 0+1= (answer 1) and 1+2= (answer 3); the tool computed 1 + 2 = 3 in its own process
    assert ep.turn_rewards == [[0.0], [0.0], [1.0], [1.0]] and ep.turns.tolist() == [2] * 4
    prompt, completion, n = row(ro, 2)
    assert "calc_add" in tok.decode(prompt)  # the MCP tool's schema reached the chat template
    env = ro.env_mask[2, :n].bool()
    assert "<tool_response>3</tool_response>" in tok.decode(torch.tensor(completion)[env])


def test_splits_are_fixed_disjoint_and_a_small_taskset_keeps_half_to_train():
    task = VerifiersTask.from_spec("verifiers:gspo-vf-say", {"count": 6}, test_size=500)
    assert task.test_size == 3 and "6 tasks; 3 held out for evaluation" in task.notes[0]
    held = {ex.columns[TASK_COLUMN] for ex in task.test_set()}
    steps = [[ex.columns[TASK_COLUMN] for ex in task.train_batch(s, 3, seed=1)] for s in (1, 2)]
    assert held == {0, 1, 2} and sorted(steps[0]) == [3, 4, 5] and sorted(steps[1]) == [3, 4, 5]
    assert steps == [[ex.columns[TASK_COLUMN] for ex in task.train_batch(s, 3, seed=1)] for s in (1, 2)]
    with pytest.raises(EnvError, match=r"task verifiers:gspo-vf-say: no option colour \(its options: .*count"):
        VerifiersTask.from_spec("verifiers:gspo-vf-say", {"colour": "red"})
    with pytest.raises(EnvError, match="verifiers cannot load this taskset"):
        VerifiersTask.from_spec("verifiers:gspo-vf-missing", {})


def test_a_failing_rubric_fails_its_episodes_in_one_line(tiny, capsys):
    _, tok = tiny
    task = VerifiersTask.from_spec("verifiers:gspo-vf-say", {"count": 4, "broken": True}, test_size=1)
    ro, ep = play(tiny, task, Scripted(tok, lambda prompt: "ok"), G=2)
    assert ep.failed.tolist() == [True, True] and ro.completion_mask.sum() == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("gspo: agent verifiers:gspo-vf-say")]
    assert len(lines) == 2 and "the rubric is broken" in lines[0] and lines[0].endswith("failed, reward 0")


def test_gspo_train_runs_a_verifiers_taskset_by_id(tmp_path):
    cmd = [sys.executable, "-m", "gspo", "train", "--model", "tiny-tool", "--task", "verifiers:gspo-vf-say",
           "--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "6",
           "--eval-size", "2", "--no-progress", "--output-dir", str(tmp_path / "run")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "agent verifiers:gspo-vf-say() over an OpenAI endpoint" in p.stdout + p.stderr
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[-1]["agent/failed_frac"] == 0.0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval_after"]["metric"] == "environment" and summary["eval_after"]["n"] == 2
    bad = subprocess.run(cmd[:-1] + [str(tmp_path / "run2"), "--task-option", "colour=red"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith(
        "gspo train: error: task verifiers:gspo-vf-say: no option colour (its options:")
    assert not (tmp_path / "run2" / "metrics.jsonl").exists()


def test_the_python_api_takes_a_verifiers_env_object(tmp_path):
    import verifiers.v1 as vf

    import gspo

    config = vf.resolve_env_config({"taskset": {"id": "gspo-vf-say", "count": 4},
                                    "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}})
    env = vf.load_environment(config)
    cfg = gspo.TrainConfig(model="tiny-tool", steps=1, prompts_per_step=2, group_size=2, max_new_tokens=6,
                           eval_size=0, output_dir=str(tmp_path / "run"), progress=False)
    summary = gspo.Trainer(cfg, env=env).train(log=lambda *a, **k: None)
    assert summary["steps"] == 1
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "verifiers:gspo-vf-say" in saved
    from gspo.config import ConfigError

    with pytest.raises(ConfigError, match="a verifiers environment brings its own tasks"):
        gspo.Trainer(cfg, env=env, train_dataset=[{"prompt": "x"}])


def test_the_harness_gets_the_key_and_keeps_it_to_itself():
    from verifiers.v1.runtimes.subprocess import SubprocessConfig, SubprocessRuntime

    async def child_environment():  # what a process verifiers starts (a harness program, a tool server) inherits
        runtime = SubprocessRuntime(SubprocessConfig())
        await runtime.start()
        try:
            out = await runtime.run([sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"], {})
            return json.loads(out.stdout)
        finally:
            await runtime.stop()

    with endpoint_key("secret-1") as one, endpoint_key("secret-2") as two:  # two runs' secrets in one process
        assert one != two and os.environ[one] == "secret-1" and os.environ[two] == "secret-2"
        with endpoint_key("secret-1") as again:  # another episode of the first run
            assert again == one
        assert os.environ[one] == "secret-1"  # still held by the first episode
        inherited = asyncio.run(child_environment())
        assert inherited and one not in inherited and not {"secret-1", "secret-2"} & set(inherited.values())
    assert one not in os.environ and two not in os.environ


def failing_provisioning(monkeypatch):
    """verifiers' subprocess runtime as on a machine where its harness's program was never
    prepared in this process and preparing it fails (uv cannot reach the index) while `on[0]`."""
    from verifiers.v1.runtimes.base import ProgramResult
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    on, real = [True], SubprocessRuntime.run

    async def run(self, argv, env):
        if on[0] and argv[:2] == ["sh", "-c"] and "uv sync --script" in argv[2]:
            await asyncio.sleep(0.3)  # the other episodes wait on verifiers' lock meanwhile
            return ProgramResult(1, "", "error: the package index is unreachable")
        return await real(self, argv, env)

    monkeypatch.setattr(SubprocessRuntime, "run", run)
    monkeypatch.setattr(SubprocessRuntime, "_interpreters", {})
    monkeypatch.setattr(SubprocessRuntime, "_locks", {})
    return on


def test_a_failed_setup_does_not_poison_the_next_steps(tiny, monkeypatch, capsys):
    from verifiers.v1.env import Env

    _, tok = tiny
    say = lambda: VerifiersTask.from_spec("verifiers:gspo-vf-say", {"count": 4}, test_size=2)  # noqa: E731
    task, other = say(), say()  # `other`: another run of the process (another agent, another event loop)
    starts, start = [], Env.start

    async def serving_fails_once(self):  # the environment's serving resources fail to start, in the first step
        starts.append(self)
        if len(starts) == 1:
            raise OSError("the tool server did not start")
        await start(self)

    monkeypatch.setattr(Env, "start", serving_fails_once)
    with pytest.raises(EnvError, match=r"^agent verifiers:gspo-vf-say: OSError: the tool server did not start$"):
        play(tiny, task, Scripted(tok, lambda prompt: "ok"))
    failing = failing_provisioning(monkeypatch)
    for step in (1, 2):  # the harness's setup fails in every episode, and in the same way in the next step
        ro, ep = play(tiny, task, Scripted(tok, lambda prompt: "ok"))
        lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("gspo: agent")]
        assert ep.failed.tolist() == [True] * 4 and len(lines) == 4, (step, lines)
        assert all("failed to prepare uv script: error: the package index is unreachable" in x for x in lines), lines
    failing[0] = False  # the index is back: the next run prepares the program and plays
    ro, ep = play(tiny, other, Scripted(tok, lambda prompt: "ok"))
    err = capsys.readouterr().err
    assert "bound to a different event loop" not in err, err[-2000:]
    assert ep.failed.tolist() == [False] * 4 and ep.turn_rewards == [[1.0], [1.0], [0.0], [0.0]]


def test_a_session_left_closing_does_not_take_the_next_ones_environment():
    task = VerifiersTask.from_spec("verifiers:gspo-vf-say", {"count": 4}, test_size=2)
    agent, limits = task.default_env, SimpleNamespace(max_calls=4)

    async def overlapping():  # a step's session still closing (left in the background) while the next one opens
        async with agent.session(limits):
            first = agent.env
            async with agent.session(limits):
                second = agent.env
                assert second is not first and second._interception is not first._interception  # served apart
            assert agent.env is first and first._interception is not None  # still serving the first's episodes
        assert agent.env is None

    asyncio.run(overlapping())


def offline(monkeypatch):
    """No network but loopback: every proxy variable pointing at a closed port."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
        monkeypatch.setenv(name.lower(), "http://127.0.0.1:9")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(name, "127.0.0.1,localhost")
    for name in ("UV_DEFAULT_INDEX", "UV_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)


def test_a_harness_that_cannot_be_provisioned_offline_is_refused_in_one_line(tmp_path, monkeypatch):
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    offline(monkeypatch)
    monkeypatch.setattr(SubprocessRuntime, "_interpreters", {})
    monkeypatch.setattr(SubprocessRuntime, "scripts_dir", str(tmp_path / "scripts"))  # never prepared here
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))  # nothing in uv's cache
    with pytest.raises(EnvError) as e:
        VerifiersTask.from_spec("verifiers:gspo-vf-say", {"count": 4}, test_size=2)
    line = str(e.value)
    assert "\n" not in line and line.startswith(
        "task verifiers:gspo-vf-say: verifiers' null harness is not provisioned on this machine and cannot be "
        "offline: its chat program needs the program's packages in uv's cache (openai, mcp==2.0.0, ")
    assert "the package index is unreachable (https://pypi.org/simple: " in line
    assert line.endswith("provision it once with network: python -c 'import gspo.agents.vfenv as v; v.provision()'")

    # no uv at all (verifiers would install it with pip, from the index)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", "/bin"]))
    if shutil.which("uv"):
        pytest.skip("uv is installed system-wide here")
    with pytest.raises(EnvError, match=r"its chat program needs uv \(not on PATH nor in ~/.local/bin\) and the "
                                       r"program's packages \(openai, "):
        VerifiersTask.from_spec("verifiers:gspo-vf-say", {"count": 4}, test_size=2)


def test_a_provisioned_harness_plays_offline(tiny, monkeypatch):
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    _, tok = tiny
    assert os.path.exists(vfenv.provision())  # what the refusal above asks for, with network, once
    offline(monkeypatch)
    monkeypatch.setattr(SubprocessRuntime, "_interpreters", {})  # a new process on this machine
    task = VerifiersTask.from_spec("verifiers:gspo-vf-say", {"count": 4}, test_size=2)  # not refused
    # ready from uv's cache, so verifiers does not ask the index for it again (uv would, once its cache is stale)
    assert list(SubprocessRuntime._interpreters) == [vfenv._script_path()]
    ro, ep = play(tiny, task, Scripted(tok, lambda prompt: "ok"))
    assert ep.failed.tolist() == [False] * 4 and ep.turn_rewards == [[1.0], [1.0], [0.0], [0.0]]


def old_order(name, seed, steps, n, held, size):
    """The training order before it was cached: every draw shuffled its epoch's order anew."""
    out = []
    for step in steps:
        train, batch = list(range(held, size)), []
        for j in range((step - 1) * n, step * n):
            epoch, k = divmod(j, len(train))
            order = train[:]
            random.Random(f"verifiers-{name}-{seed}-{epoch}").shuffle(order)
            batch.append(order[k])
        out.append(batch)
    return out


def test_the_task_order_is_shuffled_once_per_epoch(monkeypatch):
    task = VerifiersTask.from_spec("verifiers:gspo-vf-say", {"count": 10}, test_size=2)  # 8 to train on
    steps = range(1, 7)  # 18 draws of 3: epochs 0, 1 and 2, steps 3 and 6 across a boundary
    want = old_order("verifiers:gspo-vf-say", 7, steps, 3, 2, 10)
    shuffles = []

    class Counted(random.Random):
        def shuffle(self, x):
            shuffles.append(len(x))
            super().shuffle(x)

    monkeypatch.setattr(vfenv.random, "Random", Counted)
    got = [[ex.columns[TASK_COLUMN] for ex in task.train_batch(s, 3, seed=7)] for s in steps]
    assert got == want
    assert shuffles == [8, 8, 8]  # once per epoch (the old way: 18, one per draw)
    assert [ex.columns[TASK_COLUMN] for ex in task.train_batch(6, 3, seed=7)] == want[-1] and len(shuffles) == 3
