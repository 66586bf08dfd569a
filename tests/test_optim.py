"""The policy's AdamW: fused where torch's fused kernel serves the parameters, and equal to the
per-tensor AdamW to float rounding."""

import torch

from gspo.config import TrainConfig
from gspo.train.optim import adamw, fusable


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def test_fused_adamw_takes_the_per_tensor_steps():
    cfg = TrainConfig(weight_decay=0.1)
    fused, plain = _model(), _model()
    opt_fused = adamw(fused.parameters(), 1e-2, cfg)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2, betas=cfg.optim.adam_betas,
                                  weight_decay=cfg.optim.weight_decay)
    assert opt_fused.defaults["fused"] is True and not opt_plain.defaults.get("fused")
    x = torch.randn(64, 16)
    for _ in range(5):
        for model, opt in ((fused, opt_fused), (plain, opt_plain)):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    start = _model()
    for a, b, p0 in zip(fused.parameters(), plain.parameters(), start.parameters()):
        # 5 steps of lr 1e-2 moved every weight by up to ~5e-2; the two agree to 1e-6 of that
        assert (a - p0).abs().max() > 1e-2
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


class _Sharded(torch.Tensor):
    """Stands in for FSDP's DTensor: a tensor subclass."""


def test_fused_only_where_the_kernel_serves():
    cfg = TrainConfig()
    plain = [torch.nn.Parameter(torch.zeros(3))]
    assert fusable(plain, cfg)
    assert fusable([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], cfg)
    assert not fusable(plain, TrainConfig(dtype="float16"))  # the fp16 loss scaler unscales before the step
    assert not fusable([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))], cfg)
    assert not fusable([torch.nn.Parameter(torch.zeros(3).as_subclass(_Sharded))], cfg)
    assert not fusable([], cfg)
