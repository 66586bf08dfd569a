"""Reports of comparisons that went wrong somewhere: a seed without a final accuracy (first or
not), a NaN wall time, two configurations that are the very same runs, one difference judged, a
p-value below 0.0001. Each is a compare.json as gspo compare writes it, rendered again by
gspo.lab.report.rerender (an independent recheck of the stored reports found each one)."""

import json
import math

import pytest

from gspo.config import TrainConfig
from gspo.lab.report import rerender


def seed(acc, wall=30.0, diverged=False):
    return {"accuracy": acc, "accuracy_before": 0.2, "diverged": diverged, "wall_seconds": wall}


def render(tmp_path, seeds: dict, eval_n=None) -> tuple[str, dict]:
    (tmp_path / "compare.json").write_text(json.dumps({name: {"seeds": s} for name, s in seeds.items()}))
    rerender(tmp_path, TrainConfig(model="tiny", steps=60), eval_n=eval_n)
    return (tmp_path / "report.md").read_text(), json.loads((tmp_path / "compare.json").read_text())


def test_a_first_seed_without_a_final_accuracy_is_named_not_a_crash(tmp_path):
    # aggregate took its keys from the first seed alone: A's seed 0 has no "accuracy", so A had no
    # "accuracy" figure and report.md's table raised KeyError. Now A's mean is over seeds 1 and 2,
    # (0.55 + 0.52)/2 = 0.535, and report.md says which seed it left out
    a = {"0": {"accuracy_before": 0.2, "diverged": True, "wall_seconds": 30.0}, "1": seed(0.55), "2": seed(0.52)}
    md, stored = render(tmp_path, {"A": a, "B": {"0": seed(0.45), "1": seed(0.47), "2": seed(0.49)}})
    assert stored["A"]["accuracy"] == pytest.approx(0.535)
    assert "| A | 20.0% -> n/a -> 53.5% ±" in md
    assert "- A: seed 0 of 3 recorded no final accuracy (left out of its mean and its differences)." in md
    # A - B pairs over seeds 1 and 2: (0.55 - 0.47 + 0.52 - 0.49)/2 = 0.055
    assert "- A - B: +5.5 ±" in md and "(paired over 2 seeds;" in md


def test_a_nan_final_accuracy_is_named(tmp_path):
    # a diverged seed's NaN left the mean silently: A read (0.50 + 0.52)/2 = 51.0%, as good as its survivors
    md, _ = render(tmp_path, {"A": {"0": seed(0.50), "1": seed(math.nan, diverged=True), "2": seed(0.52)},
                              "B": {"0": seed(0.45), "1": seed(0.47), "2": seed(None)}})
    assert "- A: seed 1 of 3 recorded no final accuracy (left out of its mean and its differences)." in md
    assert "- B: seed 2 of 3 recorded no final accuracy" in md
    assert "| A | 20.0% -> n/a -> 51.0% ±" in md and "| 1/3 |" in md


def test_a_nan_wall_time_is_left_out_of_the_minutes(tmp_path):
    # the header read "6 runs trained in nan minutes"; now 5 x 30 s = 2.5 minutes, and the seed named
    md, _ = render(tmp_path, {"A": {"0": seed(0.50), "1": seed(0.55), "2": seed(0.52, wall=math.nan)},
                              "B": {"0": seed(0.45), "1": seed(0.47), "2": seed(0.49)}})
    assert "6 runs trained in 2.5 minutes" in md and "nan" not in md
    assert "- A: seed 2 of 3 recorded no wall time (left out of the minutes trained)." in md


def test_only_the_same_runs_says_so_rather_than_one_seed(tmp_path):
    # A and B are the very same runs (linked: the same figures to the wall time) on 3 seeds: the report
    # said "No difference judged: one seed gives no interval."
    same = {"0": seed(0.50), "1": seed(0.55), "2": seed(0.52)}
    md, _ = render(tmp_path, {"A": same, "B": dict(same)})
    assert "No difference judged: the same runs (linked) are not compared." in md
    assert "one seed" not in md
    md, _ = render(tmp_path, {"A": {"0": seed(0.5)}, "B": {"0": seed(0.4)}})
    assert "No difference judged: one seed gives no interval." in md


def test_one_difference_and_a_tiny_p_value_read_as_english(tmp_path):
    # A - B = 0.30, 0.31, 0.29 over 3 seeds, no held-out problems: mean 0.30, s = 0.01, t = 0.30/(0.01/sqrt3)
    # = 51.96 on 2 df, p = 1 - t/sqrt(2 + t^2) = 3.7e-4; make it smaller with 4 seeds (0.30, 0.31, 0.29, 0.30:
    # s = 0.008165, t = 73.5 on 3 df, p ~ 5e-6)
    md, _ = render(tmp_path, {"A": {str(i): seed(0.6 + d) for i, d in enumerate((0.30, 0.31, 0.29, 0.30))},
                              "B": {str(i): seed(0.6) for i in range(4)}})
    assert "**1 difference judged**" in md and "1 differences" not in md
    assert "(paired over 4 seeds; p < 0.0001, Holm-adjusted < 0.0001): outside the noise" in md
    assert "p = <" not in md


def test_configurations_on_different_held_out_sizes_say_both(tmp_path):
    # the objectives study scored arithmetic on 200 problems and the chain task on 100: the noise line said
    # "measured on 100 problems"
    one = {"A": {str(i): {**seed(0.5 + 0.01 * i), "eval_n": 100} for i in range(3)},
           "B": {str(i): {**seed(0.4 + 0.02 * i), "eval_n": 200} for i in range(3)}}
    md, _ = render(tmp_path, one)
    assert "One held-out accuracy is measured on 100 to 200 problems (the configurations differ)" in md
