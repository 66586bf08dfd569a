"""The vLLM sampler's calls into its engine, checked with a recording fake engine (no vLLM needed).

The real `VLLMSampler` is built over a fake `vllm` module whose `LLM` records every call and
refuses to generate while asleep. The protocol under test (sleep mode on, as on CUDA): the
engine sleeps once built; a rollout wakes it (the CUDA cache emptied first), loads the weights,
then every `generate` of the rollout (one per turn of a multi-turn episode) runs awake, and
it sleeps once, after the rollout's last `generate`. Also here: the vLLM version floor and the
`--old-logp auto` rule for `--min-new-tokens` (the engine's first log-probs are not the policy's).
"""

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from gspo.config import VLLM, TrainConfig
from gspo.models.tiny import build_chat_tokenizer
from gspo.sampling import vllm_engine
from gspo.sampling.produce import rollout
from gspo.sampling.rollout import sampling_params
from gspo.sampling.vllm_engine import EngineError, VLLMSampler, check_version
from gspo.tasks.calculator import CalculatorTask
from gspo.tasks.env import Environment, Step
from gspo.train.resolve import resolve

TURN = "12<|im_end|>"  # every model turn: an answer that ends the turn


class FakeLLM:
    """Records its calls (`log`); answers every prompt with TURN; a `generate` while asleep is logged
    as "generate-asleep"."""

    def __init__(self, log, tok, **kw):
        self.log, self.tok, self.kw, self.asleep = log, tok, kw, False

    def sleep(self, level):
        self.log.append("sleep")
        self.asleep = True

    def wake_up(self):
        self.log.append("wake_up")
        self.asleep = False

    def collective_rpc(self, method, kwargs=None):
        self.log.append(method)
        list(kwargs["weights_iterator"])

    def apply_model(self, fn):
        self.log.append("apply_model")

    def reset_prefix_cache(self):
        self.log.append("reset_prefix_cache")

    def generate(self, prompts, requests, use_tqdm=False):
        self.log.append("generate-asleep" if self.asleep else "generate")
        ids = self.tok(TURN, add_special_tokens=False)["input_ids"]
        c = SimpleNamespace(token_ids=ids, logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in ids],
                            finish_reason="stop")
        return [SimpleNamespace(outputs=[c] * r["n"]) for r in requests]


def fake_vllm(log, tok, version="0.32.0"):
    mod = types.ModuleType("vllm")
    mod.__version__ = version
    mod.LLM = lambda **kw: FakeLLM(log, tok, **kw)
    mod.SamplingParams = dict
    mod.platforms = SimpleNamespace(current_platform=SimpleNamespace(is_sleep_mode_available=lambda: True))
    return mod


class ThreeTurns(Environment):
    """Answers every model turn with a user message; done after the third."""

    def reset(self, example):
        self.k = 0

    def step(self, text):
        self.k += 1
        return Step([{"role": "user", "content": f"again {self.k}"}], done=self.k == 3)


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


@pytest.fixture
def engine(tok, monkeypatch):
    log = []
    monkeypatch.setattr(vllm_engine, "empty_cache", lambda device: log.append("empty_cache"))
    sampler = VLLMSampler("model", VLLM(vllm_max_model_len=4096), dtype="float32", seed=0, vllm=fake_vllm(log, tok))
    return sampler, log


def run_for(sampler, tok, env=None, max_turns=1):
    from gspo.sampling.episodes import run_episodes

    cfg = TrainConfig(group_size=2, prompts_per_step=1, max_new_tokens=80)
    return SimpleNamespace(cfg=cfg, dist=SimpleNamespace(rank=0, max_int=lambda n: n), tokenizer=tok, stop_ids=None,
                           policy=torch.nn.Linear(2, 2), sampler=sampler, env=env, max_turns=max_turns,
                           play=run_episodes)  # a SamplingSide's: gspo's multi-turn loop plays an environment


WAKE_AND_SYNC = ["empty_cache", "wake_up", "reload_weights", "apply_model", "reset_prefix_cache"]


def test_single_turn_rollouts_generate_awake_and_sleep_once_after(engine, tok):
    sampler, log = engine
    assert log == ["sleep"] and sampler.llm.kw["enable_sleep_mode"]  # built asleep: the memory is the trainer's
    run = run_for(sampler, tok)
    for _ in range(2):  # two steps: each wakes, syncs, generates awake, sleeps
        rollout(run, CalculatorTask().test_set(1), step=0)
    assert log == ["sleep"] + (WAKE_AND_SYNC + ["generate", "sleep"]) * 2


def test_multi_turn_rollout_generates_every_turn_awake(engine, tok):
    # run_episodes samples once per turn: three generates, all awake, then a single sleep
    sampler, log = engine
    ro, texts, ids, ep = rollout(run_for(sampler, tok, env=ThreeTurns, max_turns=3), CalculatorTask().test_set(1), 0)
    assert ep.turns.tolist() == [3, 3]
    assert log == ["sleep"] + WAKE_AND_SYNC + ["generate"] * 3 + ["sleep"]


def test_sample_wakes_a_sleeping_engine_without_a_sync(engine, tok):
    # a Python user sampling again after end_rollout (no sync: the weights are the engine's own)
    sampler, log = engine
    params = sampling_params(tok, group_size=2, max_new_tokens=8)
    sampler.sample([[1, 2, 3]], params)
    sampler.sample([[1, 2, 3]], params)
    sampler.end_rollout()
    sampler.end_rollout()  # idempotent
    assert log == ["sleep", "empty_cache", "wake_up", "generate", "generate", "sleep"]


def test_no_sleep_where_the_platform_has_none(tok):
    log = []
    mod = fake_vllm(log, tok)
    mod.platforms.current_platform.is_sleep_mode_available = lambda: False  # CPU
    sampler = VLLMSampler("model", VLLM(vllm_max_model_len=4096), dtype="float32", seed=0, vllm=mod)
    sampler.sample([[1, 2, 3]], sampling_params(tok, group_size=1, max_new_tokens=8))
    sampler.end_rollout()
    assert log == ["generate"] and "enable_sleep_mode" not in sampler.llm.kw


def test_cpu_engine_prefills_whole_prompts(engine):
    # chunked prefill off on CPU (a discarded partial-prefill token rewinds the request's seeded
    # generator, which CPU generators refuse); the token budget then holds the longest prompt
    sampler, _ = engine
    assert sampler.llm.kw["enable_chunked_prefill"] is False and sampler.llm.kw["max_num_batched_tokens"] >= 4096


@pytest.mark.parametrize("installed, refused", [("0.11.0", True), ("0.15.1", True), ("0.16.0", False),
                                                ("0.32.0", False), ("0.33.0rc1.dev12+gabc", False), ("dev", False)])
def test_version_floor(installed, refused):
    if refused:
        with pytest.raises(EngineError, match=rf"^rollout_engine: vllm needs vllm>=0\.16 \(installed: {installed}\)$"):
            check_version(installed)
    else:
        check_version(installed)


def test_an_old_vllm_is_refused_in_one_line_at_engine_start(capsys, tmp_path, monkeypatch, tok):
    from gspo.cli import main

    monkeypatch.setitem(sys.modules, "vllm", fake_vllm([], tok, version="0.11.0"))
    code = main(["train", "--rollout-engine", "vllm", "--steps", "1", "--output-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["gspo train: error: rollout_engine: vllm needs vllm>=0.16 (installed: 0.11.0)"]


@pytest.mark.parametrize("engine_name, min_new_tokens, old_logp", [
    ("vllm", 0, "sampling"),  # the engine's log-probs are the policy's: pi_old without a recomputation
    ("vllm", 3, "recompute"),  # vLLM renormalises the first 3 without the banned stop tokens
    ("hf", 3, "sampling"),  # gspo's sampler records the full distribution's
])
def test_old_logp_auto_with_min_new_tokens(engine_name, min_new_tokens, old_logp):
    cfg = resolve(TrainConfig(rollout_engine=engine_name, min_new_tokens=min_new_tokens, output_dir="x"))
    assert cfg.old_logp == old_logp


def test_explicit_sampling_logprobs_with_vllm_and_min_new_tokens_is_refused():
    """--old-logp sampling would take vLLM's renormalised first log-probs as pi_old: one line instead."""
    from gspo.config import ConfigError

    with pytest.raises(ConfigError, match=r"^old_logp: sampling with --rollout-engine vllm needs --top-p 1, --top-k 0 "
                                          r"and --min-new-tokens 0: "):
        resolve(TrainConfig(rollout_engine="vllm", old_logp="sampling", min_new_tokens=2, output_dir="x"))
    assert resolve(TrainConfig(old_logp="sampling", min_new_tokens=2, output_dir="x")).old_logp == "sampling"  # hf
