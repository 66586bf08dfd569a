"""FSDP with bf16 compute: the sampler is the sharded policy itself, gathered in bf16 for each
rollout (no unsharded copy per process). It used to crash at the first rollout: the sampler
was an unsharded bf16 copy synced from DTensor parameters. Torchrun runs are compared with the
one-process bf16 run of tests/test_distributed.py's helpers.
"""

import math

import pytest
import torch

from gspo.io.files import read_jsonl
from gspo.processes.distributed import Dist
from gspo.train import checkpoint as ckpt
from tests.conftest import spawn
from tests.test_distributed import metrics, one_process, torchrun

pytestmark = pytest.mark.slow

BF16 = ["--prompts-per-step", "4", "--group-size", "4", "--eval-size", "8", "--max-new-tokens", "8", "--steps", "2",
        "--dtype", "bfloat16", "--no-progress", "--seed", "3"]


@pytest.fixture(scope="module")
def single_bf16(tmp_path_factory):
    """The 1-process mixed-precision run: it samples with a bf16 copy of the fp32 weights."""
    run = tmp_path_factory.mktemp("single-bf16") / "run"
    r = one_process(*BF16, "--output-dir", str(run))
    assert r.returncode == 0, r.stderr
    return run


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_fsdp_bf16_samples_with_the_sharded_policy(tmp_path, single_bf16, param_dtype):
    # used to crash at the first rollout: the sampler was an unsharded bf16 copy synced from
    # DTensor parameters. Mixed (fp32 master weights, gathered in bf16) and pure bf16 alike
    run = tmp_path / "run"
    r = torchrun(*BF16, "--param-dtype", param_dtype, "--parallel", "fsdp", "--output-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    said = [ln for ln in r.stderr.splitlines() if "fsdp samples with the sharded policy itself" in ln]
    assert len(said) == 1 and "in bfloat16" in said[0] and "compact decode step" in said[0], said
    assert ckpt.latest_checkpoint(run).name == "step-000002"
    assert "old_logp: recompute" in (run / "config.yaml").read_text()  # bf16 sampling log-probs are recomputed
    m, ref = metrics(run), metrics(single_bf16)
    assert all(math.isfinite(row["reward/mean"]) for row in m)
    # the sampler computes in bf16, as the trainer's forward under FSDP (parameters gathered in
    # bf16) does: their log-probs agree to ~2e-7 per token; an fp32 sampler would be ~8e-3 away
    # (the mean |Δ logp| between the fp32 and bf16 tiny model on the same tokens)
    assert all(0 <= row["mismatch/token_abs"] < 1e-4 for row in m), [row["mismatch/token_abs"] for row in m]
    # step 1 samples from the initial weights: the same completions as the bf16 copy of one
    # process (sampling draws the same numbers for a row however the rows are split)
    for k in ("reward/mean", "completion/mean_length", "completion/max_length", "completion/truncated_frac"):
        assert m[0][k] == ref[0][k], k
    first = lambda d: [s for s in read_jsonl(d / "samples.jsonl") if s["step"] == 1]  # noqa: E731
    assert first(run) == first(single_bf16) and len(first(run)) == 4


# two prompts a process; each process's longest is 7 tokens, as is the whole batch's: both layouts pad alike
PROMPTS_BF16 = ("12+7=", "397+48=", "5+5=", "100+23=")


def _bf16_sampler_worker(rank: int, init_file: str, out_dir: str):
    import torch.distributed as td
    from torch.distributed.device_mesh import init_device_mesh

    import gspo.sampling.rollout as rollout_module
    from gspo.models.loading import load_policy
    from gspo.models.logprobs import TokenLogprobs
    from gspo.processes.parallel import wrap

    torch.set_num_threads(1)
    td.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    d = Dist(rank=rank, world=2, parallel="fsdp", mesh=init_device_mesh("cpu", (2,)))
    policy, tok = load_policy("tiny")
    root = wrap(TokenLogprobs(policy), d, mixed=torch.bfloat16)
    seen, real = [], rollout_module.decoder

    def spy(model, max_len, **kw):  # what the sampler decodes with, and the weights it reads
        dec, w = real(model, max_len, **kw), model.model.layers[0].self_attn.q_proj.weight
        seen.append((type(dec).__name__, w.dtype, hasattr(w, "placements")))
        return dec

    rollout_module.decoder = spy
    prompts = [tok(p)["input_ids"] for p in PROMPTS_BF16[2 * rank:2 * rank + 2]]
    ro = rollout_module.PolicySampler(policy, dist=d, root=root).sample(
        prompts, rollout_module.sampling_params(tok, group_size=4, max_new_tokens=8),
        generator=torch.Generator().manual_seed(0), rows=(8 * rank, 16))
    after = hasattr(policy.model.layers[0].self_attn.q_proj.weight, "placements")  # resharded
    torch.save({"ro": ro, "seen": seen, "after": after}, f"{out_dir}/{rank}.pt")
    td.destroy_process_group()


def test_fsdp_bf16_sampler_records_the_bf16_copys_logprobs(tmp_path):
    # the sharded policy, gathered in bf16 by its MixedPrecisionPolicy, samples what a bf16
    # copy of the weights samples in one process: the same tokens and log-probs. The tolerance
    # separates the precisions: an fp32 sampler's log-probs are > 1e-2 away on these tokens
    from gspo.models.loading import load_policy, low_precision_copy
    from gspo.sampling.rollout import generate, sampling_params

    spawn(_bf16_sampler_worker, str(tmp_path / "init"), str(tmp_path))
    policy, tok = load_policy("tiny")
    prompts, params = [tok(p)["input_ids"] for p in PROMPTS_BF16], sampling_params(tok, group_size=4, max_new_tokens=8)
    fp32, bf16 = (generate(m, prompts, params, generator=torch.Generator().manual_seed(0))  # all 16 rows at once
                  for m in (policy, low_precision_copy(policy, torch.bfloat16)))
    for r in (0, 1):
        o = torch.load(tmp_path / f"{r}.pt", weights_only=False)
        assert o["seen"] == [("FastDecoder", torch.bfloat16, False)] and o["after"], o["seen"]
        rows, T = slice(8 * r, 8 * r + 8), o["ro"].completion_ids.shape[1]
        assert torch.equal(o["ro"].completion_ids, bf16.completion_ids[rows, :T])
        assert bf16.completion_mask[rows, T:].sum() == 0  # the one-process rows ended by then too
        torch.testing.assert_close(o["ro"].logp, bf16.logp[rows, :T], atol=1e-3, rtol=0)
        assert float((o["ro"].logp - fp32.logp[rows, :T]).abs().max()) > 1e-2
