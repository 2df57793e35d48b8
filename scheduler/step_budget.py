"""Step budget: how many prefill tokens a step that carries decodes may take, from step times.

``StepTimeModel`` learns ``seconds ≈ a + b·prefill_tokens + c·decodes`` online from measured
steps (recursive least squares with forgetting, so it follows a machine whose speed drifts).
``StepBudget`` turns it into the prefill token budget of a step with ``decodes`` running: what
fits in the target time of such a step, a fixed ``target_ms`` or ``factor`` × the predicted
decode-only time of that step. A step without decodes keeps the full budget (its time costs
no stream an inter-token gap), and a step with decodes always gets at least ``min_tokens``
of prefill, so a waiting prompt is never starved.

Until the model has seen steps with prefill and steps with decodes, or while it predicts no
positive cost per prefill token or no positive decode time, the budget is the full one (as if unbounded): a model that
knows nothing does not throttle. Torch-free; one ``observe`` and one ``prefill_budget`` per
step, a few microseconds each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: feature scales: the regression runs on O(1) features, which keeps its covariance well
#: conditioned whatever the token counts
_PREFILL_SCALE = 1024.0
_DECODE_SCALE = 16.0
#: initial covariance (seconds² per unit feature): weak enough that the first few steps decide
_PRIOR_VARIANCE = 1e4
#: cap on the covariance's trace: steps that do not vary a feature (long decode-only runs)
#: would otherwise let its variance grow without bound under forgetting
_MAX_TRACE = 1e6
#: once fitted, one measurement moves the fit by at most this factor of the prediction: a
#: stray slow step (a collection pause, a first call's allocations) is damped, a real change
#: of speed still gets through within a few steps
_MAX_RATIO = 4.0
#: observations of each kind (with prefill, with decodes) before the model is trusted
MIN_OBSERVATIONS = 2
#: observations before measurements are clipped to the prediction (an early fit may be far off)
_CLIP_AFTER = 16


@dataclass
class StepTimeModel:
    """``seconds ≈ a + b·prefill_tokens + c·decodes``, fitted by recursive least squares.

    ``forgetting`` in (0, 1]: the weight of an observation decays by it per later one (0.98
    remembers about the last 50 steps). Measurements of steps that computed nothing
    (copies only) carry no information on the coefficients and are ignored.
    """

    forgetting: float = 0.98
    theta: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    cov: list[list[float]] = field(
        default_factory=lambda: [[_PRIOR_VARIANCE if i == j else 0.0 for j in range(3)] for i in range(3)]
    )
    steps: int = 0  # observations
    prefill_steps: int = 0  # observations with prefill tokens
    decode_steps: int = 0  # observations with decodes

    def __post_init__(self) -> None:
        if not 0.0 < self.forgetting <= 1.0:
            raise ValueError(f"forgetting = {self.forgetting}: must be in (0, 1]")

    @property
    def ready(self) -> bool:
        """Enough steps of both kinds seen to predict either."""
        return self.prefill_steps >= MIN_OBSERVATIONS and self.decode_steps >= MIN_OBSERVATIONS

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(a seconds, b seconds per prefill token, c seconds per decode)."""
        a, b, c = self.theta
        return a, b / _PREFILL_SCALE, c / _DECODE_SCALE

    def predict(self, prefill_tokens: int, decodes: int) -> float:
        """Predicted seconds of a step with this work."""
        x = _features(prefill_tokens, decodes)
        return sum(t * xi for t, xi in zip(self.theta, x, strict=True))

    def observe(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        """Fold one measured step into the fit."""
        if prefill_tokens <= 0 and decodes <= 0:
            return
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"step time {seconds!r}: must be a finite number of seconds >= 0")
        x = _features(prefill_tokens, decodes)
        pred = self.predict(prefill_tokens, decodes)
        if self.steps >= _CLIP_AFTER and pred > 0:
            seconds = min(max(seconds, pred / _MAX_RATIO), pred * _MAX_RATIO)
        lam, p = self.forgetting, self.cov
        px = [sum(p[i][j] * x[j] for j in range(3)) for i in range(3)]
        denom = lam + sum(x[i] * px[i] for i in range(3))
        gain = [v / denom for v in px]
        err = seconds - pred
        self.theta = [t + g * err for t, g in zip(self.theta, gain, strict=True)]
        # P ← (P − g·xᵀP) / λ, kept symmetric
        new = [[(p[i][j] - gain[i] * px[j]) / lam for j in range(3)] for i in range(3)]
        for i in range(3):
            for j in range(i):
                new[i][j] = new[j][i] = 0.5 * (new[i][j] + new[j][i])
        trace = new[0][0] + new[1][1] + new[2][2]
        if trace > _MAX_TRACE:
            new = [[v * (_MAX_TRACE / trace) for v in row] for row in new]
        self.cov = new
        self.steps += 1
        self.prefill_steps += prefill_tokens > 0
        self.decode_steps += decodes > 0


@dataclass
class StepBudget:
    """The prefill token budget of a step with decodes (module docstring).

    ``factor`` > 1: the target is ``factor`` × the predicted decode-only time of the step;
    ``target_ms`` > 0 replaces it with a fixed time. ``min_tokens``: the prefill every step
    with decodes may take at least (a checkpoint unit: less is no chunk at all).
    """

    min_tokens: int
    factor: float = 2.0
    target_ms: float = 0.0
    model: StepTimeModel = field(default_factory=StepTimeModel)
    last_budget: int = -1  # the last budget given to a step with decodes (-1: unbounded so far)

    def __post_init__(self) -> None:
        if self.min_tokens < 1:
            raise ValueError(f"min_tokens = {self.min_tokens}: must be >= 1")
        if self.factor != 0 and self.factor <= 1.0:
            raise ValueError(f"factor = {self.factor}: must be > 1 (or 0 with target_ms)")
        if self.target_ms < 0 or (self.factor == 0 and self.target_ms == 0):
            raise ValueError(f"target_ms = {self.target_ms}: must be > 0 when factor is 0")

    def target_s(self, decodes: int) -> float:
        """Target time of a step with ``decodes`` decodes."""
        if self.target_ms > 0:
            return self.target_ms / 1000.0
        return self.factor * self.model.predict(0, decodes)

    def prefill_budget(self, decodes: int, full: int) -> int:
        """Prefill tokens a step with ``decodes`` decodes may carry, out of ``full``."""
        if decodes <= 0:
            return full
        model = self.model
        per_token = model.coefficients[1]
        decode_s = model.predict(0, decodes)
        if not model.ready or per_token <= 0 or decode_s <= 0:
            return full  # (a fit that predicts no time cannot be planned with)
        spare = self.target_s(decodes) - decode_s
        fits = int(spare / per_token) if spare > 0 else 0
        budget = min(full, max(self.min_tokens, fits))
        self.last_budget = budget
        return budget

    def observe(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        self.model.observe(prefill_tokens, decodes, seconds)

    def stats(self) -> dict[str, float]:
        a, b, c = self.model.coefficients
        return {
            "scheduler.step_model.base_ms": a * 1000.0,
            "scheduler.step_model.prefill_us_per_token": b * 1e6,
            "scheduler.step_model.decode_ms_each": c * 1000.0,
            "scheduler.decode_step_prefill_budget": float(self.last_budget),
        }


def _features(prefill_tokens: int, decodes: int) -> tuple[float, float, float]:
    return 1.0, prefill_tokens / _PREFILL_SCALE, decodes / _DECODE_SCALE
