"""`gspo compare --preset staleness` and `--preset precision` (gspo.lab.studies) at toy size, end to end,
and the study's expansion, levels and noise pairs."""

import json

import numpy as np
import pytest

from gspo.cli import main
from gspo.config import ConfigError
from gspo.lab.studies import PRECISION, STALENESS, TASKS, Study, levels_arg

TOY = ["--prompts-per-step", "2", "--group-size", "2", "--num-minibatches", "1", "--eval-size", "4",
       "--max-new-tokens", "6", "--no-progress"]


def test_a_study_is_every_configuration_at_every_level():
    study = Study(STALENESS, (0, 2), (("gspo", {"algorithm": "gspo"}), ("cispo", {"algorithm": "cispo", "lr": 1e-5})))
    assert study.expand() == [
        ("gspo@K0", {"algorithm": "gspo", "max_staleness": 0}), ("gspo@K2", {"algorithm": "gspo", "max_staleness": 2}),
        ("cispo@K0", {"algorithm": "cispo", "lr": 1e-5, "max_staleness": 0}),
        ("cispo@K2", {"algorithm": "cispo", "lr": 1e-5, "max_staleness": 2})]
    # each lag against K = 0 within a loss; each loss against the first at every lag
    assert study.pairs() == [("gspo@K2", "gspo@K0"), ("cispo@K2", "cispo@K0"),
                             ("cispo@K0", "gspo@K0"), ("cispo@K2", "gspo@K2")]
    p = Study(PRECISION, ("float32", "float16"), (("grpo", {"algorithm": "grpo"}),))
    assert [n for n, _ in p.expand()] == ["grpo@fp32", "grpo@fp16"]
    # fp32 master weights, the sampler a copy in the same dtype, pi_old recomputed (so the gap is measured)
    assert p.expand()[1][1] == {"algorithm": "grpo", "dtype": "float16", "param_dtype": "float32",
                                "rollout_dtype": "same", "old_logp": "recompute"}
    # a configuration's own options win over the study's fixed ones; the factor itself it cannot set
    mine = Study(PRECISION, ("bfloat16",), (("x", {"algorithm": "gspo", "rollout_dtype": "float32"}),))
    assert mine.expand()[0][1]["rollout_dtype"] == "float32"
    with pytest.raises(ConfigError, match="--max-staleness is the factor this study varies"):
        Study(STALENESS, (0,), (("y", {"max_staleness": 4}),)).expand()


@pytest.mark.parametrize("axis,values,msg", [
    (STALENESS, ["2", "x"], "--lags: expected int values, got 2 x"),
    (STALENESS, ["0", "-1"], "--lags: each must be >= 0"),
    (STALENESS, ["2", "2"], "--lags: expected distinct values"),
    (PRECISION, ["float32", "fp8"], "--precisions: each must be one of float32, bfloat16, float16, got float32 fp8"),
])
def test_bad_levels_are_refused_in_one_line(axis, values, msg):
    with pytest.raises(ConfigError) as e:
        levels_arg(axis, values)
    assert str(e.value) == msg or str(e.value).startswith(msg)


def test_level_flags_belong_to_their_preset(tmp_path, capsys):
    assert main(["compare", "--lags", "0", "2", "--output-dir", str(tmp_path / "c")]) == 2
    assert "--lags: only with --preset staleness" in capsys.readouterr().err
    assert main(["compare", "--preset", "staleness", "--precisions", "float16", "--output-dir",
                 str(tmp_path / "c")]) == 2
    assert "--precisions: only with --preset precision" in capsys.readouterr().err
    assert main(["compare", "--preset", "staleness", "--lags", "1", "one", "--output-dir", str(tmp_path / "c")]) == 2
    assert "--lags: expected int values, got 1 one" in capsys.readouterr().err
    assert main(["compare", "--preset", "precision", "--dtype", "bfloat16", "--output-dir", str(tmp_path / "c")]) == 2
    assert "--dtype: the precision study varies it; choose its values with --precisions" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


@pytest.mark.slow  # starts a process
def test_staleness_preset_end_to_end(tmp_path, capsys):
    out = tmp_path / "st"
    code = main(["compare", "--preset", "staleness", "--configs", "gspo", "gspo-behaviour", "--lags", "0", "2",
                 "--seeds", "0", "1", "--steps", "3", "--eval-every", "3", *TOY, "--output-dir", str(out)])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "compare.json").read_text())
    assert set(report) == {"gspo@K0", "gspo@K2", "gspo-behaviour@K0", "gspo-behaviour@K2"}
    # K = 2 over 3 steps: batch t sampled by version max(0, t-3), trained by t-1: staleness 0, 1, 2, mean 1
    for name in ("gspo@K2", "gspo-behaviour@K2"):
        assert report[name]["staleness_mean"] == 1.0 and report[name]["staleness_mean_ci95"] == 0.0
    assert report["gspo@K0"]["staleness_mean"] == 0.0
    cfg = (out / "runs" / "gspo-behaviour@K2-seed1" / "config.yaml").read_text()
    assert "max_staleness: 2" in cfg and "old_logp: sampling" in cfg and "model: tiny-moe" in cfg
    assert "old_logp: recompute" in (out / "runs" / "gspo@K2-seed1" / "config.yaml").read_text()  # auto: proximal
    # at K = 0 both anchors are the sampling pass: one run, linked, not trained twice
    assert (out / "runs" / "gspo-behaviour@K0-seed0").resolve() == (out / "runs" / "gspo@K0-seed0").resolve()
    assert report["gspo-behaviour@K0"]["accuracy"] == report["gspo@K0"]["accuracy"]
    # the recomputed (proximal) anchor logs the behaviour/proximal gap; the behaviour anchor has none to log
    assert report["gspo@K2"]["mismatch_seq_mean"] > 0 and report["gspo-behaviour@K2"]["mismatch_seq_mean"] is None
    study = json.loads((out / "study.json").read_text())
    assert study["axis"] == "K" and study["levels"] == [0, 2]
    acc = study["figures"]["accuracy"]["gspo-behaviour"]["K2"]
    assert acc == {"mean": report["gspo-behaviour@K2"]["accuracy"],
                   "ci95": report["gspo-behaviour@K2"]["accuracy_ci95"]}
    md = (out / "report.md").read_text()
    assert "; 6 runs trained in " in md  # 4 configurations x 2 seeds, the 2 linked ones not counted
    assert "## Against K" in md and "| configuration | K0 | K2 |" in md and "**final held-out accuracy**" in md
    assert "- gspo@K2 - gspo@K0: " in md and "- gspo-behaviour@K2 - gspo@K2: " in md
    assert "- gspo@K2 - gspo-behaviour@K0" not in md  # only the study's pairs are judged
    for png in ("accuracy_vs_K.png", "clip_frac_vs_K.png", "seq_log_abs_vs_K.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG" and png in md


@pytest.mark.slow  # starts a process
def test_precision_preset_end_to_end(tmp_path, capsys):
    out = tmp_path / "pr"
    code = main(["compare", "--preset", "precision", "--configs", "gspo-tis", "--precisions", "float32", "bfloat16",
                 "--seeds", "0", "--steps", "2", "--eval-every", "2", *TOY, "--output-dir", str(out)])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "compare.json").read_text())
    assert set(report) == {"gspo-tis@fp32", "gspo-tis@bf16"}
    cfg = (out / "runs" / "gspo-tis@bf16-seed0" / "config.yaml").read_text()
    assert "dtype: bfloat16" in cfg and "param_dtype: float32" in cfg and "old_logp: recompute" in cfg
    # the same weights in bf16 (sampler) and under bf16 autocast (trainer) part by far more than fp32's rounding
    fp32, bf16 = report["gspo-tis@fp32"]["mismatch_mean"], report["gspo-tis@bf16"]["mismatch_mean"]
    assert fp32 < 1e-4 < bf16, (fp32, bf16)
    md = (out / "report.md").read_text()
    assert "## Against precision" in md and "| configuration | fp32 | bf16 |" in md
    for png in ("accuracy_vs_precision.png", "mismatch_vs_precision.png", "mismatch_seq_vs_precision.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG" and png in md


def test_each_task_brings_its_model_and_sizes_and_the_users_options_hold_over_them():
    study = Study(TASKS, ("chain", "arithmetic"), (("gspo", {}), ("ctpo", {"algorithm": "ctpo", "steps": 3})))
    runs = dict(study.expand())
    assert runs["gspo@chain"] == {"model": "tiny-long-moe", "steps": 10, "prompts_per_step": 8, "eval_every": 5,
                                  "eval_size": 100, "lr": 2e-4, "samples_per_step": 2, "task": "chain"}
    assert runs["gspo@arithmetic"] == {"model": "tiny-moe", "steps": 20, "eval_every": 5, "eval_size": 200,
                                       "task": "arithmetic"}
    assert runs["ctpo@chain"]["steps"] == 3  # a configuration's own option over the task's
    mine = Study(TASKS.leaving({"steps", "lr"}), study.levels, study.configs).expand()
    assert dict(mine)["gspo@chain"]["model"] == "tiny-long-moe" and "steps" not in dict(mine)["gspo@chain"]
    assert "lr" not in dict(mine)["gspo@chain"]  # given for the whole comparison: the base's value holds
    # the tasks are not rivals: each configuration against the first, at each task, and nothing else
    assert study.pairs() == [("ctpo@chain", "gspo@chain"), ("ctpo@arithmetic", "gspo@arithmetic")]


def test_the_options_a_user_gives_are_found_on_the_command_line_and_in_the_config_file(tmp_path):
    # what a comparison's own flags and --config file set holds at every task (TASKS.leaving): gspo's names,
    # TRL's names mapped (--learning_rate is lr), --no-X flags, and the config file's keys
    from gspo.cli import _given_options

    config = tmp_path / "mine.yaml"
    config.write_text("model: my-model\nnum_generations: 4\n")
    given = _given_options(["--learning_rate", "1e-3", "--no-progress", "--eval-size=50"], str(config))
    assert {"lr", "progress", "eval_size", "model", "group_size"} <= given
    assert "steps" not in given
    kept = dict(Study(TASKS.leaving(given), ("chain",), (("gspo", {}),)).expand())["gspo@chain"]
    assert "model" not in kept and "lr" not in kept and "eval_size" not in kept and kept["steps"] == 10


@pytest.mark.slow  # starts a process
def test_objectives_preset_end_to_end(tmp_path, capsys):
    out = tmp_path / "obj"
    code = main(["compare", "--preset", "objectives", "--configs", "gspo-target", "dppo_tv", "--tasks", "chain",
                 "--seeds", "0", "--steps", "2", "--eval-size", "8", "--prompts-per-step", "2",
                 "--output-dir", str(out)])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "compare.json").read_text())
    assert set(report) == {"gspo-target@chain", "dppo_tv@chain"}
    cfg = (out / "runs" / "gspo-target@chain-seed0" / "config.yaml").read_text()
    assert "model: tiny-long-moe" in cfg and "target_clip_frac: 0.15" in cfg and "steps: 2" in cfg
    md = (out / "report.md").read_text()
    assert "at task chain: model `tiny-long-moe`, task `chain`, 2 steps of 2 prompts" in md
    assert "dppo_tv@chain - gspo-target@chain" in md


STALENESS_CONFIGS = ("gspo", "grpo", "grpo-rr", "cispo", "gspo-behaviour", "grpo-behaviour")  # the preset's


def _staleness_report(values, seeds=3, eval_n=None):
    """A staleness preset's compare.json shape: values(i, name, figure, seed) -> each seed's figure,
    `<config>-behaviour@K0` the very same runs as `<config>@K0` (linked, as compare trains them)."""
    study = Study(STALENESS, (0, 2, 8), tuple((c, {}) for c in STALENESS_CONFIGS))
    report = {}
    for i, (name, _) in enumerate(study.expand()):
        base = name.replace("-behaviour@K0", "@K0")
        report[name] = report.get(base) or {"seeds": {str(s): {
            "accuracy": values(i, name, 0, s), "accuracy_curve_mean": values(i, name, 1, s),
            "diverged": False, "wall_seconds": 20.0 + i, **({"eval_n": eval_n} if eval_n else {})}
            for s in range(seeds)}}
    return study, report


@pytest.mark.slow  # 3 s
def test_simulated_staleness_reports_mark_few_differences_after_the_correction():
    """The staleness preset's own family, with no true effect: 6 configurations x K = 0, 2, 8 on 3
    seeds, each seed's final and averaged accuracy its mean plus normal noise (sd 0.02), the 27
    pairs of Study.pairs x 2 figures = 54 differences, as report.md lists them. Two of the pairs are
    the same runs (gspo-behaviour@K0 - gspo@K0, for 2 figures) and two repeat another
    (grpo-behaviour@K0 - gspo@K0 is grpo@K0 - gspo@K0): 50 judged. The old rule never marks the
    same runs (0 ± 0) and marks each of the other 52 lines with probability 0.05: 52 x 0.05 = 2.6
    a report, and, the differences sharing configurations, at least one in about 90% of reports
    (here: 2.54 and 90.1%). Holm's correction holds the familywise 5% whatever the dependence
    (here: 4.5%). 1000 reports: sd sqrt(0.9 x 0.1 / 1000) = 0.0095 and sqrt(0.05 x 0.95 / 1000)
    = 0.0069, and the mean count's sqrt(52 x 0.05 x 0.95 / 1000) = 0.035 (more, the lines being
    dependent)."""
    from gspo.lab.report import judge
    from gspo.lab.stats import outside_noise, paired_ci95

    rng = np.random.default_rng(42)
    reports = 1000
    noise = rng.normal(0.0, 0.02, size=(reports, 18, 2, 3))
    old_any = new_any = old_marked = 0
    for r in range(reports):
        study, report = _staleness_report(lambda i, name, f, s, r=r: (0.8, 0.7)[f] + float(noise[r, i, f, s]))
        old = sum(bool(outside_noise(*paired_ci95([report[a]["seeds"][s][key] for s in "012"],
                                                  [report[b]["seeds"][s][key] for s in "012"])))
                  for key in ("accuracy", "accuracy_curve_mean") for a, b in study.pairs())
        verdict = judge(report, study.pairs(), ("accuracy", "accuracy_curve_mean"))
        assert verdict["judged"] == 50 and len(verdict["differences"]) == 54
        old_marked += old
        old_any += old > 0
        new_any += verdict["outside"] > 0
    assert old_marked / reports == pytest.approx(2.6, abs=0.2)
    assert old_any / reports >= 0.85
    assert new_any / reports <= 0.07  # the familywise 5%, plus 3 sd of slack


def test_a_study_is_read_back_from_its_names():
    from gspo.lab.studies import study_from_names

    study = Study(STALENESS, (0, 2, 8), tuple((c, {}) for c in STALENESS_CONFIGS))
    again = study_from_names(STALENESS, [n for n, _ in study.expand()])
    assert again.levels == (0, 2, 8) and [c for c, _ in again.configs] == list(STALENESS_CONFIGS)
    assert again.pairs() == study.pairs()
    p = study_from_names(PRECISION, ["gspo@fp32", "gspo@bf16", "grpo-tis@fp32", "grpo-tis@bf16"])
    assert p.levels == ("float32", "bfloat16") and [c for c, _ in p.configs] == ["gspo", "grpo-tis"]
    with pytest.raises(ConfigError, match="'gspo' is not a configuration of a study along K"):
        study_from_names(STALENESS, ["gspo"])
    with pytest.raises(ConfigError, match="'fp8' is not a level of precision"):
        study_from_names(PRECISION, ["gspo@fp8"])


def test_a_stored_study_is_judged_again_without_its_runs(tmp_path):
    """gspo.lab.report.rerender on a stored compare.json (no runs/ beside it): the figures aggregated
    again from the seeds', every difference judged together, compare.json given "judged"."""
    from gspo.config import TrainConfig
    from gspo.lab.report import rerender

    # final accuracy 0.80 + 0.01 x (seed - 1) everywhere, but cispo@K8: 0.70, 0.72, 0.71 (10 points down on
    # every seed); the averaged accuracy 0.70 + 0.005 x i x (seed - 1), i the configuration's place
    def values(i, name, figure, seed):
        if figure == 1:
            return 0.70 + 0.005 * i * (seed - 1)
        return (0.71 if name == "cispo@K8" else 0.80) + 0.01 * (seed - 1)

    _, report = _staleness_report(values)  # stored before eval_n was recorded: given to rerender
    (tmp_path / "compare.json").write_text(json.dumps(report))
    out = rerender(tmp_path, TrainConfig(steps=80, model="tiny-moe"), axis=STALENESS, eval_n=500)
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert {k: v["seeds"] for k, v in saved.items()} == {k: v["seeds"] for k, v in report.items()}
    # cispo@K8: 0.71 mean, s = 0.01: the seeds' part 0.0001/3 = 3.33333e-5, the 500 problems' 0.71 x 0.29 / 500
    # = 0.0004118: half = sqrt(4.3026527^2 x 3.33333e-5 + 1.959964^2 x 0.0004118) = sqrt(0.000617094 +
    # 0.001581929) = 0.0468936; at 0.80: sqrt(0.000617094 + 1.959964^2 x 0.00032) = 0.0429693
    assert out["cispo@K8"]["accuracy_ci95"] == pytest.approx(0.0468935684, rel=1e-8)
    assert out["cispo@K0"]["accuracy_ci95"] == pytest.approx(0.0429693011, rel=1e-8)
    judged = saved["cispo@K8"]["judged"]  # the report's family, and the differences cispo@K8 is the first term of
    assert judged["judged"] == 50 and sum(len(v["judged"]["differences"]) for v in saved.values()) == 54
    cispo = [d for d in judged["differences"] if (d["b"], d["figure"]) == ("cispo@K0", "accuracy")]
    # -0.09 on every seed (s = 0): the seeds agree exactly, so only the held-out sets' noise is left, on
    # infinite df: var (0.71 x 0.29 + 0.80 x 0.20) / 500 = 0.0007318, z = 0.09 / 0.0270518 = 3.32695,
    # p = 0.000878020 (the normal's). cispo@K8 - gspo@K8 is the same -0.09 with the same p; every other
    # difference is 0 on every seed (p = 1). Holm over 50: the two smallest, tied, 50 x 0.000878 = 0.0439
    # and max(0.0439, 49 x 0.000878): both outside the noise, the 48 others within
    assert cispo[0]["p"] == pytest.approx(0.000878020470, rel=1e-6)
    assert cispo[0]["p_holm"] == pytest.approx(0.0439010235, rel=1e-6)
    assert cispo[0]["verdict"] == "outside the noise" and judged["outside"] == 2
    assert cispo[0]["p_seeds"] == 0.0  # the seeds alone: no spread at all, the difference is certain
    md = (tmp_path / "report.md").read_text()
    assert "this report re-rendered from compare.json" in md and "; 48 runs trained in " in md
    assert "**50 differences judged**" in md and "**2 outside the noise.**" in md
    assert "- gspo-behaviour@K0 - gspo@K0: the same runs (trained once, linked): +0.0 points of final accuracy" in md
    assert "the same runs as grpo@K0 - gspo@K0, counted once" in md
    assert "| cispo | 80.0% ± 4.3 | 80.0% ± 4.3 | 71.0% ± 4.7 |" in (tmp_path / "study.md").read_text()
