"""LoRA with the options that once refused it: PPO's separate critic, and FSDP sharding.

- `--algorithm ppo --lora-r R --critic separate`: the policy trains its adapters (the base
  frozen), the critic is the base model's trunk with a value head, trained in full weights;
  both checkpoint and resume exactly.
- `--parallel fsdp --lora-r R` (2 processes, slow): see test_fsdp_lora_* below.
"""

import shutil

import pytest
import torch
from safetensors.torch import load_file

import gspo
from gspo.io.files import read_jsonl
from gspo.models.loading import add_lora, load_policy, unwrap
from gspo.models.value import Critic
from gspo.train import checkpoint as ckpt
from tests.test_distributed import ARGS, assert_same_metrics, metrics, one_process, torchrun

FAST = dict(prompts_per_step=4, group_size=4, eval_size=8, max_new_tokens=8, progress=False, seed=3)
PPO_LORA = dict(algorithm="ppo", lora_r=4, critic="separate", save_every=1, keep_checkpoints=5, **FAST)


def deterministic(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def test_critic_from_a_lora_model_is_the_base_trunk_with_full_weights(tiny_random):
    plain = Critic.from_model(tiny_random)
    lora = Critic.from_model(unwrap(add_lora(tiny_random, r=4, alpha=8, dropout=0.0, target_modules=["q_proj"])))
    assert not [k for k in lora.state_dict() if "lora" in k or "base_layer" in k]
    assert lora.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(lora.state_dict()[k], v) for k, v in plain.state_dict().items())
    assert all(p.requires_grad for p in lora.parameters())  # PEFT froze the base; the critic trains it


@pytest.mark.slow
def test_ppo_lora_with_separate_critic_trains_checkpoints_and_resumes(tmp_path):
    base, _ = load_policy("tiny")
    base_sd = {k: v.clone() for k, v in base.state_dict().items()}

    full = tmp_path / "full"
    trainer = gspo.Trainer(gspo.TrainConfig(steps=3, output_dir=str(full), **PPO_LORA))
    trainer.train()
    # the policy's base weights stayed, its adapters moved
    policy = unwrap(trainer.model)
    for name, p in policy.named_parameters():
        if "lora_" in name:
            continue
        key = name.replace(".base_layer", "")
        assert torch.equal(p.detach(), base_sd[key]), name
    last = ckpt.latest_checkpoint(full)
    adapter = load_file(last / "adapter_model.safetensors")
    assert any(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)  # B starts at 0: it trained
    # the critic is a full model (no adapters) whose trunk weights moved away from the base's
    critic = load_file(last / "critic" / "model.safetensors")
    assert not [k for k in critic if "lora" in k]
    moved = [k for k, v in critic.items() if not torch.equal(v, base_sd["model." + k])]
    assert len(moved) > len(critic) // 2, (len(moved), len(critic))

    # the same run stopped after its step-2 checkpoint, resumed to step 3: the same run
    cut = tmp_path / "cut"
    gspo.Trainer(gspo.TrainConfig(steps=3, output_dir=str(cut), **PPO_LORA)).train()
    shutil.rmtree(cut / "checkpoints" / "step-000003")
    (cut / "summary.json").unlink()
    gspo.Trainer().train(resume=cut)
    a = deterministic(read_jsonl(full / "metrics.jsonl"))
    b = deterministic(read_jsonl(cut / "metrics.jsonl"))
    assert [r["step"] for r in b] == [1, 2, 3] and a == b
    wa, wb = last, ckpt.latest_checkpoint(cut)
    for f in ("adapter_model.safetensors", "critic/model.safetensors"):
        ta, tb = load_file(wa / f), load_file(wb / f)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), f
    ha, hb = (torch.load(w / "critic" / "value_head.pt") for w in (wa, wb))
    assert all(torch.equal(ha[k], hb[k]) for k in ha)


@pytest.mark.slow
def test_fsdp_lora_matches_one_process_and_resumes(tmp_path):
    # 2 processes, the PEFT policy FSDP-sharded (frozen base and adapters in each layer's unit),
    # the KL term through the base with the adapters off (gathered through the policy's root);
    # the same metrics and adapter as one process, to float rounding (tests/test_distributed.py)
    args = [*ARGS, "--steps", "3", "--lora-r", "4", "--beta", "0.02", "--save-every", "1", "--keep-checkpoints", "5"]
    one, two = tmp_path / "one", tmp_path / "two"
    r = one_process(*args, "--output-dir", str(one))
    assert r.returncode == 0, r.stderr[-3000:]
    r = torchrun(*args, "--parallel", "fsdp", "--output-dir", str(two))
    assert r.returncode == 0, r.stderr[-3000:]

    def assert_same_adapter(a, b):
        wa, wb = (load_file(ckpt.latest_checkpoint(run) / "adapter_model.safetensors") for run in (a, b))
        assert wa.keys() == wb.keys() and any("lora_B" in k for k in wa)
        assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5  # the adapter alone: no base weights
        assert not (ckpt.latest_checkpoint(b) / "model.safetensors").exists()

    assert_same_metrics(metrics(one), metrics(two))
    assert_same_adapter(one, two)
    # stopped after its step-2 checkpoint (the adapter, the gathered AdamW state), resumed to step 3
    shutil.rmtree(two / "checkpoints" / "step-000003")
    (two / "summary.json").unlink()
    r = torchrun("--resume", str(two))
    assert r.returncode == 0, r.stderr[-3000:]
    assert [row["step"] for row in metrics(two)] == [1, 2, 3]
    assert_same_metrics(metrics(one), metrics(two))
    assert_same_adapter(one, two)
