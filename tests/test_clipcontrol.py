"""--target-clip-frac's controller (gspo.algo.clipcontrol), by hand.

GAIN = 0.5, SPAN = 100. From GSPO's preset (3e-4, 4e-4) with target F = 0.15:
    a step that clipped 0.30: e = (0.30 - 0.15)/0.15 = 1      -> both bounds x e^0.5 = 1.648721
        (4.946164e-4, 6.594885e-4)
    then 0.075: e = (0.075 - 0.15)/0.15 = -0.5                  -> x e^-0.25 = 0.778801
        (3.852071e-4, 5.136095e-4)
    then 0.90: e = 5 capped at 1                                -> x e^0.5 again
"""

import math

import pytest

from gspo.algo.clipcontrol import GAIN, SPAN, ClipController


def test_one_step_moves_both_bounds_by_the_same_factor_by_hand():
    c = ClipController(0.15, 3e-4, 4e-4)
    c.update(0.30)
    assert math.isclose(c.eps_low, 3e-4 * 1.6487212707, rel_tol=1e-9)  # 4.946164e-4
    assert math.isclose(c.eps_high, 4e-4 * 1.6487212707, rel_tol=1e-9)  # 6.594885e-4
    c.update(0.075)
    assert math.isclose(c.eps_low, 3e-4 * 1.6487212707 * 0.7788007831, rel_tol=1e-9)  # 3.852071e-4
    assert math.isclose(c.eps_high / c.eps_low, 4 / 3, rel_tol=1e-12)  # the asymmetry is kept
    before = c.eps_high
    c.update(0.90)  # e = 5, capped at 1: one noisy step moves a bound by e^0.5 at most
    assert math.isclose(c.eps_high, before * math.exp(GAIN), rel_tol=1e-12)
    c.update(float("nan"))  # a step with no tokens: no move
    assert math.isclose(c.eps_high, before * math.exp(GAIN), rel_tol=1e-12)


def test_the_bounds_stay_within_span_of_the_start_and_a_ratio_bound_within_1():
    c = ClipController(0.1, 0.2, 0.27)
    for _ in range(40):
        c.update(0.0)  # nothing clipped, ever: narrow until the floor
    assert math.isclose(c.eps_low, 0.2 / SPAN) and math.isclose(c.eps_high, 0.27 / SPAN)
    for _ in range(40):
        c.update(1.0)  # everything clipped: widen; ε_low stops at 1 (the ratio's lower bound 1 - ε_low >= 0)
    assert c.eps_low == 1.0 and math.isclose(c.eps_high, 0.27 * SPAN)
    cispo = ClipController(0.1, 1.0, 0.28)  # CISPO: ε_low = 1 is no lower bound at all, and stays so
    cispo.update(0.0)
    assert cispo.eps_low == 1.0 and cispo.eps_high < 0.28
    gmpo = ClipController(0.1, 0.4, 0.4, log_space=True)  # log-space: ε_low may exceed 1
    for _ in range(10):
        gmpo.update(1.0)
    assert gmpo.eps_low > 1.0


def test_it_holds_a_target_on_a_model_of_the_clip_fraction():
    # a clip fraction that falls as the range widens, f(ε) = 0.6 exp(-ε / 2e-4), as GSPO's does (its preset
    # 3e-4 clips 0.13 here): the target 0.3 is reached at ε* = 2e-4 ln 2 = 1.386e-4, from a start 2x above it
    f = lambda eps: 0.6 * math.exp(-eps / 2e-4)  # noqa: E731
    c = ClipController(0.3, 3e-4, 4e-4)
    for _ in range(30):
        c.update(f(c.eps_low))
    assert abs(f(c.eps_low) - 0.3) < 0.01
    assert math.isclose(c.eps_low, 2e-4 * math.log(2), rel_tol=0.05)


def test_its_state_round_trips_exactly():
    a = ClipController(0.2, 3e-4, 4e-4)
    for frac in (0.5, 0.1, 0.33):
        a.update(frac)
    b = ClipController(0.2, 3e-4, 4e-4)
    b.load_state_dict(a.state_dict())
    for frac in (0.05, 0.4):
        a.update(frac)
        b.update(frac)
    assert (a.eps_low, a.eps_high) == (b.eps_low, b.eps_high)


@pytest.mark.parametrize("target", [0.0, 1.0, -0.1])
def test_a_target_outside_0_1_is_refused(target):
    with pytest.raises(ValueError, match="target clip fraction"):
        ClipController(target, 3e-4, 4e-4)
