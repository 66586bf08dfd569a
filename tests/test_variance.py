"""The ratio-variance measurement (gspo.lab.variance): per-response quantities by hand, equal-count
bins, exact on-policy zeros, the length identity Var log Π w = L² Var log s_i, and the report."""

import math

import pytest
import torch

from gspo.config import TrainConfig
from gspo.lab.variance import (
    _binned,
    _per_response,
    length_edges,
    measure,
    one_minibatch_update,
    ratio_variance,
    sample_old,
    write_variance,
)
from gspo.train.run import build_run


def test_per_response_by_hand():
    # two responses: lengths 2 and 3; the third column of the first is padding (its 5.0 ignored)
    log_w = torch.tensor([[0.1, -0.3, 5.0], [0.3, 0.0, -0.6]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    r = _per_response(log_w, mask)
    assert r["length"].tolist() == [2.0, 3.0]
    # log Π w = Σ log w: 0.1 - 0.3 = -0.2; 0.3 + 0 - 0.6 = -0.3
    assert r["log_product"].tolist() == pytest.approx([-0.2, -0.3], abs=1e-12)
    # log s_i = Σ log w / |y|: -0.2 / 2 = -0.1; -0.3 / 3 = -0.1
    assert r["log_s"].tolist() == pytest.approx([-0.1, -0.1], abs=1e-12)
    # every real token's w with its response's length; padding left out
    assert r["w"].tolist() == pytest.approx([math.exp(0.1), math.exp(-0.3), math.exp(0.3), 1.0, math.exp(-0.6)])
    assert r["w_length"].tolist() == [2.0, 2.0, 3.0, 3.0, 3.0]


def test_length_edges_equal_count():
    lengths = torch.tensor([5.0, 1.0, 3.0, 7.0, 2.0, 8.0])
    # quantiles of 1 2 3 5 7 8 at 0, 1/2, 1: 1, (3 + 5) / 2 = 4, 8
    assert length_edges(lengths, 2) == [1.0, 4.0, 8.0]


def test_binned_variances_by_hand():
    # four responses, two of length 2 and two of length 4; bins [2, 3) and [3, 4]
    r = {"length": torch.tensor([2.0, 2.0, 4.0, 4.0], dtype=torch.float64),
         "log_product": torch.tensor([0.2, -0.2, 0.4, 0.0], dtype=torch.float64),
         "w": torch.tensor([1.0, 1.2, 0.8, 1.0, 1.0, 1.0, 1.0, 1.1, 1.1, 0.9, 0.9, 1.0], dtype=torch.float64),
         "w_length": torch.tensor([2.0] * 4 + [4.0] * 8, dtype=torch.float64)}
    r["log_s"] = r["log_product"] / r["length"]
    short, long = _binned(r, 2)
    assert (short["n"], long["n"]) == (2, 2) and (short["mean_length"], long["mean_length"]) == (2.0, 4.0)
    # Var (unbiased) of log Π w: short {0.2, -0.2}: mean 0, (0.04 + 0.04) / 1 = 0.08; long {0.4, 0}: 0.08
    assert short["log_product"] == pytest.approx(0.08) and long["log_product"] == pytest.approx(0.08)
    # log s_i: short {0.1, -0.1} -> 0.02; long {0.1, 0} -> mean 0.05, (0.0025 + 0.0025) / 1 = 0.005:
    # the same variance of log Π w gives a quarter of the variance of log s_i at twice the length (1 / L²)
    assert short["log_s"] == pytest.approx(0.02) and long["log_s"] == pytest.approx(0.005)
    # s_i = exp(log s_i): short {e^0.1, e^-0.1}
    assert short["s_seq"] == pytest.approx(torch.tensor([math.exp(0.1), math.exp(-0.1)]).var().item())
    # w pooled over the bin's tokens: short {1, 1.2, 0.8, 1}: mean 1, (0 + .04 + .04 + 0) / 3
    assert short["w_token"] == pytest.approx(0.08 / 3)


@pytest.fixture(scope="module")
def moe_run():
    cfg = TrainConfig(model="tiny-moe", prompts_per_step=4, group_size=4, lr=1e-3, eval_size=0, num_minibatches=2)
    return build_run(cfg)


def test_on_policy_ratios_are_exactly_one(moe_run):
    """No update between sampling and measuring: every ratio is 1, every variance 0, with the
    router free and with the routing replayed."""
    chunks = sample_old(moe_run, 32)
    assert sum(c[0].prompt_ids.shape[0] for c in chunks) == 32  # two chunks of 4 prompts x 4
    settings, drift = measure(moe_run, chunks, n_bins=2)
    assert set(settings) == {"router free", "routing replayed"} and drift == 0.0
    for rows in settings.values():
        assert rows and sum(r["n"] for r in rows) == 32
        for r in rows:
            for q in ("w_token", "log_product", "s_seq", "log_s"):
                assert abs(r[q]) < 1e-12, (q, r)


def test_one_update_moves_the_ratios_and_the_length_identity_holds(moe_run):
    chunks = sample_old(moe_run, 64)
    assert one_minibatch_update(moe_run) == 8  # 16 responses, 2 minibatches
    settings, drift = measure(moe_run, chunks, n_bins=4)
    assert drift is not None and drift >= 0
    free = settings["router free"]
    assert all(r["w_token"] > 1e-8 and r["log_product"] > 1e-8 for r in free)
    for r in free:
        if r["lo"] == r["hi"]:  # a bin of one length L: log Π w = L log s_i, so Var log Π w = L² Var log s_i
            assert r["log_product"] == pytest.approx(r["lo"] ** 2 * r["log_s"], rel=1e-9)


def test_ratio_variance_report(tmp_path):
    """The whole measurement on the dense built-in model, and its report files."""
    cfg = TrainConfig(model="tiny", prompts_per_step=4, group_size=4, lr=1e-3)
    r = ratio_variance(cfg, responses=32, n_bins=2, log=lambda *a: None)
    assert r["drift"] is None and set(r["settings"]) == {""} and r["responses"] == 32 and r["minibatch"] == 4
    write_variance([r], tmp_path)
    md = (tmp_path / "variance.md").read_text()
    assert "variance" in md.lower() and "| tiny | dense |" in md
    assert (tmp_path / "variance.png").read_bytes()[:4] == b"\x89PNG"
    assert "settings" in (tmp_path / "variance.json").read_text()


@pytest.mark.slow  # starts a process
def test_compare_length_preset(tmp_path, capsys):
    """`gspo compare --preset length` at toy size: its four configurations on the long-answer
    models and task, and the variance table, plot and JSON in the report directory."""
    import json

    from gspo.cli import main

    out = tmp_path / "length"
    code = main(["compare", "--preset", "length", "--steps", "1", "--seeds", "0", "--prompts-per-step", "2",
                 "--group-size", "2", "--num-minibatches", "2", "--eval-size", "2", "--variance-responses", "4",
                 "--max-new-tokens", "24", "--no-progress", "--output-dir", str(out)])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "compare.json").read_text())
    assert set(report) == {"gspo", "grpo", "grpo-rr", "gspo_token"}
    cfg = (out / "runs" / "grpo-rr-seed0" / "config.yaml").read_text()
    assert "model: tiny-long-moe" in cfg and "task: chain" in cfg and "routing_replay: true" in cfg
    variance = json.loads((out / "variance.json").read_text())
    assert [v["model"] for v in variance] == ["tiny-long-moe", "tiny-long"]
    assert set(variance[0]["settings"]) == {"router free", "routing replayed"} and variance[1]["drift"] is None
    md = (out / "report.md").read_text()
    assert "## Importance-ratio variance by response length" in md and "Var log Π w" in md and "variance.png" in md
    assert (out / "variance.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_presets_in_help_and_unknown(capsys, tmp_path):
    from gspo.cli import main

    with pytest.raises(SystemExit) as done:
        main(["compare", "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "--preset NAME" in out and "length: GSPO, GRPO" in out
    assert main(["compare", "--preset", "lenght", "--output-dir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert ("--preset: unknown preset 'lenght'; presets: paper, moe, length, staleness, staleness-chain, precision, "
            "objectives\n" in err and "Traceback" not in err)
    assert not (tmp_path / "c").exists()
