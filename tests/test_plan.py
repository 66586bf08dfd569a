"""The run's plan (gspo.train.plan): each request's resolved plan, in summary.json and said once at the start."""

import json
import os

import pytest
import torch

import gspo
from gspo.config import TrainConfig
from gspo.train.plan import describe, plan
from gspo.train.run import build_run

SMALL = dict(steps=1, prompts_per_step=2, group_size=2, eval_size=4, max_new_tokens=4, progress=False)
KEYS = {"engine", "processes", "parallel", "weights_dtype", "compute_dtype", "autocast", "sampler", "sampler_dtype",
        "old_logp", "packing", "packing_why", "micro_batch_tokens", "lm_head", "lm_head_chunk", "decode",
        "decode_why", "gradient_checkpointing", "lora", "moe", "routing_replay", "env", "max_turns", "agent",
        "rollouts", "warnings", "threads", "model", "objective", "integrity", "distill"}


def plan_of(tmp_path, **kw) -> dict:
    p = plan(build_run(TrainConfig(output_dir=str(tmp_path / "run"), **SMALL, **kw)))  # built, never trained
    assert set(p) == KEYS and json.loads(json.dumps(p)) == p  # stable keys, plain JSON values
    return p


def test_default_run(tmp_path):
    p = plan_of(tmp_path)
    assert p["engine"] == "hf" and p["processes"] == 1 and p["parallel"] == "none"
    # tests/conftest.py sets OMP_NUM_THREADS (runs compared bit for bit compute alike): gspo.processes.threads keeps it
    assert p["threads"] == {"count": torch.get_num_threads(), "why": f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}",
                            "memory": "large CPU tensors from the heap (glibc's mmap threshold 2 GiB)"}
    assert (p["weights_dtype"], p["compute_dtype"], p["autocast"]) == ("float32", "float32", False)
    assert p["sampler"] == "the policy itself" and p["sampler_dtype"] == "float32"
    assert p["old_logp"] == "sampling"  # auto, in float32: the sampler's own log-probs
    assert (p["packing"], p["packing_why"], p["micro_batch_tokens"]) == (False, "not asked", 0)
    assert p["lm_head"] == "chunked" and p["lm_head_chunk"] >= 16
    assert (p["decode"], p["decode_why"]) == ("fast", None)  # the built-in tiny is a dense Qwen3
    assert (p["lora"], p["moe"], p["routing_replay"], p["env"], p["max_turns"]) == (None, False, False, None, 1)
    assert p["integrity"] == {"on_breach": "stop", "tolerance": {"row": 1e-3, "mean": 1e-4}}  # gspo's, float32
    assert p["warnings"] == [] and p["distill"] is None


def test_bfloat16_samples_with_a_copy_and_recomputes_old_logp(tmp_path):
    p = plan_of(tmp_path, dtype="bfloat16")
    assert (p["weights_dtype"], p["compute_dtype"], p["autocast"]) == ("float32", "bfloat16", True)
    assert p["sampler"].startswith("a bfloat16 copy of the policy") and p["sampler_dtype"] == "bfloat16"
    assert p["old_logp"] == "recompute"  # auto: the sampler's bf16 log-probs are not the trainer's
    assert "compute bfloat16 (autocast)" in describe(p) and "a training forward" in describe(p)
    assert p["integrity"]["tolerance"] == {"row": 2.0, "mean": 0.25}  # sampler and trainer both compute in bfloat16
    p = plan_of(tmp_path, rollout_dtype="bfloat16")  # a bfloat16 sampler, a float32 trainer: a gap, not a breach
    assert p["integrity"] == {"on_breach": "stop", "tolerance": None}
    assert "log-probs not checked (the sampler's precision is not the trainer's" in describe(p)


def test_packing_on(tmp_path):
    p = plan_of(tmp_path, packing=True, micro_batch_tokens=64)
    assert (p["packing"], p["packing_why"], p["micro_batch_tokens"]) == (True, "asked", 64)
    assert "packing: on (asked); micro-batches: 64 tokens" in describe(p)


def test_moe_refuses_packing_with_a_warning(tmp_path):
    p = plan_of(tmp_path, model="tiny-moe", packing=True)
    assert p["packing"] is False and p["packing_why"].startswith("asked, but MoE routing")
    assert p["moe"] is True and p["routing_replay"] is False
    assert any(w.startswith("--packing: off for this MoE model") for w in p["warnings"])
    assert (p["decode"], p["decode_why"]) == ("fast", None)  # fastdecode serves Qwen3-MoE too (gspo.models.fastmoe)
    assert "warning: --packing: off" in describe(p) and "warning" not in describe(p, warnings=False)


def test_the_model_is_named_and_a_built_in_is_not_a_gguf_file(tmp_path):
    p = plan_of(tmp_path)
    assert p["model"] == {"name": "tiny", "gguf": None} and "  model:" not in describe(p)


def test_lora(tmp_path):
    p = plan_of(tmp_path, lora_r=4)
    assert p["lora"] == {"r": 4, "alpha": 16.0, "dropout": 0.0, "target_modules": ["all-linear"]}
    assert (p["decode"], p["decode_why"]) == ("fast", None)  # the hand-written step applies the adapters
    assert "LoRA r=4 (alpha 16, all-linear)" in describe(p)


@pytest.mark.slow  # trains
def test_summary_has_the_plan_said_once_at_the_start(tmp_path, capsys):
    summary = gspo.Trainer(TrainConfig(output_dir=str(tmp_path / "run"), **SMALL)).train()
    out = capsys.readouterr().out
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["plan"] == summary["plan"] and set(summary["plan"]) == KEYS
    assert out.count("plan: ") == 1 and out.startswith(describe(summary["plan"], warnings=False) + "\n")
