"""Step budget: how many prefill tokens a step that carries decodes may take, from step times.

``StepTimeModel`` learns ``seconds ≈ a + b·prefill_tokens`` online from measured steps
(recursive least squares with forgetting, so it follows a machine whose speed drifts, and the
decode batch of the moment: ``a`` is the time of a step's fixed work, the weights read once and
the running decodes). ``StepBudget`` turns it into the prefill token budget of a step with
decodes: what fits in the target time of such a step, a fixed ``target_ms`` or ``factor`` × the
decode-only step time ``a``. A step without decodes keeps the full budget (its time costs no
stream an inter-token gap), and a step with decodes always gets at least ``min_tokens`` of
prefill, so a waiting prompt is never starved.

Until the model has seen a step with prefill and one without, or while it predicts no positive
cost per prefill token, the budget is the full one: a model that knows nothing does not
throttle. (Decodes run only after some prompt was prefilled, so the first steps with decodes
already find a prefill-only step measured.) Torch-free; one ``observe`` and one
``prefill_budget`` per step, a few microseconds each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: the prefill feature's scale: the regression runs on O(1) features, which keeps its
#: covariance well conditioned whatever the token counts
_PREFILL_SCALE = 1024.0
#: initial covariance (seconds² per unit feature): weak enough that the first steps decide
_PRIOR_VARIANCE = 1e4
#: cap on the covariance's trace: steps that do not vary the prefill (long decode-only runs)
#: would otherwise let its variance grow without bound under forgetting
_MAX_TRACE = 1e6
#: once fitted, one measurement moves the fit by at most this factor of the prediction: a
#: stray slow step (a collection pause, a first call's allocations) is damped, a real change
#: of speed still gets through within a few steps
_MAX_RATIO = 4.0
#: observations before measurements are clipped to the prediction (an early fit may be far off)
_CLIP_AFTER = 16
#: how far one bounded step moves the trim toward the share that would have met the target
_TRIM_GAIN = 0.3
#: the trim's floor: the budget aims at no less than this share of the target
_TRIM_FLOOR = 0.25


@dataclass
class StepTimeModel:
    """``seconds ≈ a + b·prefill_tokens``, fitted by recursive least squares.

    ``forgetting`` in (0, 1]: the weight of an observation decays by it per later one (0.98
    remembers about the last 50 steps). Steps that computed nothing (copies only) carry no
    information and are ignored.
    """

    forgetting: float = 0.98
    theta: list[float] = field(default_factory=lambda: [0.0, 0.0])
    cov: list[list[float]] = field(default_factory=lambda: [[_PRIOR_VARIANCE, 0.0], [0.0, _PRIOR_VARIANCE]])
    steps: int = 0  # observations
    prefill_steps: int = 0  # observations with prefill tokens

    def __post_init__(self) -> None:
        if not 0.0 < self.forgetting <= 1.0:
            raise ValueError(f"forgetting = {self.forgetting}: must be in (0, 1]")

    @property
    def ready(self) -> bool:
        """A step with prefill and one without seen: both coefficients are known."""
        return 0 < self.prefill_steps < self.steps

    @property
    def coefficients(self) -> tuple[float, float]:
        """(a seconds, b seconds per prefill token)."""
        return self.theta[0], self.theta[1] / _PREFILL_SCALE

    def predict(self, prefill_tokens: int) -> float:
        """Predicted seconds of a step with this much prefill (and the usual decodes)."""
        return self.theta[0] + self.theta[1] * (prefill_tokens / _PREFILL_SCALE)

    def observe(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        """Fold one measured step into the fit."""
        if prefill_tokens <= 0 and decodes <= 0:
            return
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"step time {seconds!r}: must be a finite number of seconds >= 0")
        x = (1.0, prefill_tokens / _PREFILL_SCALE)
        pred = self.predict(prefill_tokens)
        if self.steps >= _CLIP_AFTER and pred > 0:
            seconds = min(max(seconds, pred / _MAX_RATIO), pred * _MAX_RATIO)
        lam, p = self.forgetting, self.cov
        px = (p[0][0] * x[0] + p[0][1] * x[1], p[1][0] * x[0] + p[1][1] * x[1])
        denom = lam + x[0] * px[0] + x[1] * px[1]
        gain = (px[0] / denom, px[1] / denom)
        err = seconds - pred
        self.theta = [self.theta[0] + gain[0] * err, self.theta[1] + gain[1] * err]
        # P ← (P − g·xᵀP) / λ (symmetric: xᵀP = (Px)ᵀ)
        p00 = (p[0][0] - gain[0] * px[0]) / lam
        p01 = (p[0][1] - gain[0] * px[1]) / lam
        p11 = (p[1][1] - gain[1] * px[1]) / lam
        scale = min(1.0, _MAX_TRACE / (p00 + p11)) if p00 + p11 > 0 else 1.0
        self.cov = [[p00 * scale, p01 * scale], [p01 * scale, p11 * scale]]
        self.steps += 1
        self.prefill_steps += prefill_tokens > 0


@dataclass
class StepBudget:
    """The prefill token budget of a step with decodes (module docstring).

    ``factor`` > 1: the target is ``factor`` × the decode-only step time; ``target_ms`` > 0
    replaces it with a fixed time. ``min_tokens``: the prefill every step with decodes may take
    at least (a checkpoint unit: less is no chunk at all).
    """

    min_tokens: int
    factor: float = 3.0
    target_ms: float = 0.0
    model: StepTimeModel = field(default_factory=StepTimeModel)
    last_budget: int = -1  # the last budget given to a step with decodes (-1: unbounded so far)
    # The share of the target the budget aims at. The linear model is fitted over every step,
    # and a short prefill chunk costs more a token than the fit says (per-segment work: the GDN
    # chunk padding, the conv, the attention call), so bounded steps ran ~25 % over the target
    # on a CPU. Each step whose prefill the bound cut moves the trim by _TRIM_GAIN toward
    # target / measured: over the target it shrinks, under it grows back, at most to 1.
    trim: float = 1.0
    last_cut: bool = False  # whether the last budget was cut by the target (not the step's own)

    def __post_init__(self) -> None:
        if self.min_tokens < 1:
            raise ValueError(f"min_tokens = {self.min_tokens}: must be >= 1")
        if self.factor != 0 and self.factor <= 1.0:
            raise ValueError(f"factor = {self.factor}: must be > 1 (or 0 with target_ms)")
        if self.target_ms < 0 or (self.factor == 0 and self.target_ms == 0):
            raise ValueError(f"target_ms = {self.target_ms}: must be > 0 when factor is 0")

    def target_s(self) -> float:
        """Target time of a step with decodes."""
        if self.target_ms > 0:
            return self.target_ms / 1000.0
        return self.factor * self.model.predict(0)

    def prefill_budget(self, decodes: int, full: int) -> int:
        """Prefill tokens a step with ``decodes`` decodes may carry, out of ``full``."""
        if decodes <= 0:
            return full
        model = self.model
        per_token = model.coefficients[1]
        if not model.ready or per_token <= 0:
            return full
        spare = self.trim * self.target_s() - model.predict(0)
        fits = int(spare / per_token) if spare > 0 else 0
        budget = min(full, max(self.min_tokens, fits))
        self.last_budget, self.last_cut = budget, budget < full
        return budget

    def observe(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        target = self.target_s() if self.model.ready else 0.0
        self.model.observe(prefill_tokens, decodes, seconds)
        bounded = decodes > 0 and self.last_cut and self.last_budget <= prefill_tokens
        if bounded and target > 0 and seconds > 0 and math.isfinite(seconds):
            ratio = (1.0 - _TRIM_GAIN) + _TRIM_GAIN * target / seconds
            self.trim = min(1.0, max(_TRIM_FLOOR, self.trim * ratio))

    def stats(self) -> dict[str, float]:
        a, b = self.model.coefficients
        return {
            "scheduler.step_model.base_ms": a * 1000.0,
            "scheduler.step_model.prefill_us_per_token": b * 1e6,
            "scheduler.decode_step_prefill_budget": float(self.last_budget),
            "scheduler.decode_step_trim": self.trim,
        }
