"""A clip range that sets itself: `--target-clip-frac F` holds the measured clip fraction near F.

    from gspo.algo.clipcontrol import ClipController
    ctl = ClipController(target=0.15, eps_low=3e-4, eps_high=4e-4)
    ctl.update(0.33)          # after a step that clipped 33% of its tokens: both bounds widen
    ctl.eps_low, ctl.eps_high

The controller is proportional in log space, as an adaptive-KL controller holds a KL target
(Ziegler et al. 2019, the controller TRL's and OpenRLHF's adaptive KL use): after each step,
with f the step's measured clip fraction (`clip/frac`, the mean over its updates, over every
process's tokens),

    e      = clamp((f - F) / F, -1, 1)             relative error, capped so one noisy step moves little
    ε_low  ← clamp(ε_low  · exp(GAIN · e), ε_low0 / SPAN,  ε_low0 · SPAN)
    ε_high ← clamp(ε_high · exp(GAIN · e), ε_high0 / SPAN, ε_high0 · SPAN)

with GAIN = 0.5 (one step moves a bound by a factor within [e^-0.5, e^0.5] = [0.61, 1.65]) and
SPAN = 100 around the starting range (the loss's preset, or --clip-low/--clip-high). Both bounds
move by the same factor, so the range keeps its asymmetry (ε_high/ε_low). Too many tokens
clipped (f > F): the range widens; too few: it narrows. A ratio-space lower bound stays <= 1
(the ratio is clipped at 1 - ε_low >= 0), and one that starts at 1 (CISPO's: no lower bound)
stays there; a log-space one (GMPO) has no such cap.

The state is two floats, checkpointed with the run and restored exactly (gspo.train.checkpoint).
Importing this module needs only the standard library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GAIN = 0.5  # log-space change of the bounds per unit of relative error
SPAN = 100.0  # the bounds stay within [start / SPAN, start * SPAN]


@dataclass
class ClipController:
    """The clip range of the next step's updates, adapted after each step (`update`)."""

    target: float  # F, the clip fraction to hold (0 < F < 1)
    eps_low: float  # the current range
    eps_high: float
    log_space: bool = False  # the loss clips log-ratios (GMPO): ε_low may exceed 1
    start: tuple[float, float] | None = None  # the starting range, the bounds' centre (default: the first range)

    def __post_init__(self) -> None:
        if not 0.0 < self.target < 1.0:
            raise ValueError(f"target clip fraction must be in (0, 1), got {self.target}")
        if self.eps_low <= 0 or self.eps_high <= 0:
            raise ValueError("a clip range that sets itself needs a starting range > 0 on both sides, "
                             f"got ({self.eps_low}, {self.eps_high})")
        if self.start is None:
            self.start = (self.eps_low, self.eps_high)

    def update(self, clip_frac: float) -> None:
        """Move the range after a step whose measured clip fraction was `clip_frac` (NaN: no tokens, no move)."""
        if math.isnan(clip_frac):
            return
        error = max(-1.0, min(1.0, (clip_frac - self.target) / self.target))
        factor = math.exp(GAIN * error)
        low0, high0 = self.start
        self.eps_low = min(max(self.eps_low * factor, low0 / SPAN), low0 * SPAN)
        self.eps_high = min(max(self.eps_high * factor, high0 / SPAN), high0 * SPAN)
        if not self.log_space:  # a ratio-space lower bound of 1 or more is no bound (CISPO's): it stays so
            self.eps_low = low0 if low0 >= 1.0 else min(self.eps_low, 1.0)

    def state_dict(self) -> dict:
        return {"target": self.target, "eps_low": self.eps_low, "eps_high": self.eps_high,
                "start": list(self.start)}

    def load_state_dict(self, state: dict) -> None:
        self.eps_low, self.eps_high = float(state["eps_low"]), float(state["eps_high"])
        self.start = tuple(state["start"])


__all__ = ["GAIN", "SPAN", "ClipController"]
