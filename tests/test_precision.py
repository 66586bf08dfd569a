"""Mixed precision, the sampler's low-precision copy, and dropout: a real checkpoint trains correctly.

Each test here failed before its fix: bf16 weights trained directly by AdamW (updates at lr 1e-6
vanish below bf16's resolution), fp16 weights (NaN in two steps), a sampler copy made by
casting the whole model (RoPE's inv_freq in bf16), and LoRA dropout on in the updates but off
in the old-policy pass (the "on-policy" ratios were not 1).
"""

import pytest
import torch

from gspo.config import ConfigError, TrainConfig
from gspo.models.loading import disable_dropout, load_policy, low_precision_copy
from gspo.train.resolve import resolve
from gspo.train.run import build_run
from gspo.train.trainer import train_step

FAST = dict(prompts_per_step=4, group_size=4, eval_size=8, progress=False)


def test_low_precision_copy_keeps_rope_in_float32():
    model, _ = load_policy("tiny")
    copy = low_precision_copy(model, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in copy.parameters())
    assert copy.model.rotary_emb.inv_freq.dtype == torch.float32  # as a loader leaves it
    assert torch.equal(copy.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    # what casting the whole model did: inv_freq rounded to bf16, a phase error that grows with the
    # position (at position 4096 the fastest frequency, 1 rad/token, is off by inv_freq's rounding x 4096)
    cast = model.to(torch.bfloat16).model.rotary_emb.inv_freq
    err = (cast.float() - copy.model.rotary_emb.inv_freq).abs().max() * 4096
    assert cast.dtype == torch.bfloat16 and err > 0.1
    assert all(p.dtype == torch.float32 for p in load_policy("tiny")[0].parameters())  # the original untouched


@pytest.mark.slow  # trains
def test_mixed_precision_keeps_float32_master_weights(tmp_path):
    cfg = TrainConfig(dtype="bfloat16", lr=1e-6, warmup_steps=0, steps=2, output_dir=str(tmp_path / "r"), **FAST)
    run = build_run(cfg)
    assert all(p.dtype == torch.float32 for p in run.policy.parameters())  # master weights
    assert all(p.dtype == torch.bfloat16 for p in run.sampler.model.parameters())  # the sampler: an engine's copy
    assert run.sampler.model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert resolve(cfg).old_logp == "recompute"  # bf16 sampling log-probs are not the training forward's
    before = {n: p.detach().clone() for n, p in run.policy.named_parameters()}
    for step in (1, 2):
        m, _ = train_step(run, step)
    changed = sum(int((p != before[n]).sum()) for n, p in run.policy.named_parameters())
    total = sum(p.numel() for p in run.policy.parameters())
    # Adam moves every weight with a gradient by ~lr per update: 1e-6 is far below bf16's
    # resolution at |w| ~ 0.02 (2^-7 relative, ~1.5e-4), so bf16 weights kept < 1% of the updates
    assert changed / total > 0.9, changed / total
    state = run.optimizer.state[next(iter(run.policy.parameters()))]
    assert state["exp_avg"].dtype == torch.float32
    assert 0 < m["mismatch/token_abs"] < 0.1  # bf16 sampler vs the mixed-precision training forward


def test_pure_bf16_is_asked_for_by_name(tmp_path):
    run = build_run(TrainConfig(dtype="bfloat16", param_dtype="bfloat16", output_dir=str(tmp_path / "r"), **FAST))
    assert all(p.dtype == torch.bfloat16 for p in run.policy.parameters())
    assert run.sampler.model is run.policy  # nothing to copy: it samples with itself


@pytest.mark.slow  # trains
def test_float16_trains_with_loss_scaling(tmp_path):
    run = build_run(TrainConfig(dtype="float16", lr=1e-4, output_dir=str(tmp_path / "r"), **FAST))
    assert run.scaler is not None and all(p.dtype == torch.float32 for p in run.policy.parameters())
    for step in (1, 2, 3):
        m, _ = train_step(run, step)
    assert all(torch.isfinite(p).all() for p in run.policy.parameters())
    assert run.scaler.get_scale() > 1.0
    # the loss scale is part of the checkpoint, so a resumed run scales as an uninterrupted one
    from gspo.train import checkpoint as ckpt

    run.scaler.update(1234.0)
    run.run_dir.mkdir()
    (run.run_dir / "config.yaml").write_text(ckpt.config_yaml(run.cfg))
    ckpt.save_run(run, 3)
    again = build_run(None, resume=tmp_path / "r")
    ckpt.restore_run(again)
    assert again.scaler.get_scale() == 1234.0 and again.progress.start_step == 3


@pytest.mark.parametrize("changes,field", [
    ({"dtype": "bfloat16", "param_dtype": "float16"}, "param_dtype"),
    ({"dtype": "float16", "param_dtype": "float16"}, "param_dtype"),
    ({"dtype": "float16", "parallel": "fsdp"}, "dtype"),
    ({"micro_batch_tokens": -1}, "micro_batch_tokens"),
])
def test_precision_options_are_checked(changes, field):
    with pytest.raises(ConfigError) as e:
        resolve(TrainConfig(**changes))
    assert str(e.value).startswith(field + ":") and "\n" not in str(e.value)


@pytest.mark.slow  # trains
def test_dropout_is_off_in_the_updates(tmp_path):
    # LoRA dropout 0.05 and one minibatch: every update is on-policy, so with dropout off in the
    # training forward as in the old-policy pass, every ratio is 1 and nothing clips
    cfg = TrainConfig(lora_r=4, lora_dropout=0.05, num_minibatches=1, old_logp="recompute",
                      output_dir=str(tmp_path / "r"), **FAST)
    run = build_run(cfg)
    assert all(m.p == 0.0 for m in run.policy.modules() if isinstance(m, torch.nn.Dropout))
    m, _ = train_step(run, 1)
    assert abs(m["ratio/min"] - 1) < 1e-5 and abs(m["ratio/max"] - 1) < 1e-5 and m["clip/frac"] == 0.0


def test_disable_dropout_reaches_attention_modules(tiny_random):
    tiny_random.config.attention_dropout = 0.1
    for layer in tiny_random.model.layers:
        layer.self_attn.attention_dropout = 0.1
    disable_dropout(tiny_random)
    assert tiny_random.config.attention_dropout == 0.0
    assert all(layer.self_attn.attention_dropout == 0.0 for layer in tiny_random.model.layers)
