"""Step times fitted to the measured steps (``StepTimes``), and what the engine does with
them: a prompt-chunk cap that follows the decodes (``MixedStepBudget``,
``max_mixed_step_ratio`` R, ``--max-mixed-step-ratio``; 0, the default: off), and the end of
a step with prompt tokens for late dispatch (``late_dispatch.py``).

``StepTimes`` fits a decode-only step of D decodes, ``t_dec(D) = a + b * D``, and the extra
time of a step with P prompt tokens beside decodes over ``t_dec`` of its decodes, as
exponentially weighted least squares over the recent steps (``DECODE_DECAY``,
``MIXED_DECAY``). Step times are the steps' device spans (CUDA events); where there are
none (a CPU device) the host time of the dispatch, which on a CPU device runs the forward
(``on_device`` then says False, and late dispatch does not use them). Steps that compiled
a kernel, and steps without decodes, are not fitted.

The cap. A running request's inter-token latency is the time of the steps it decodes in. A
step that also prefills prompt tokens takes longer than a decode-only step, by about a
fixed cost per prompt token, so a long prompt arriving beside running decodes makes one
long gap in every stream: the ITL tail. ``long_prefill_token_threshold`` cuts each prompt's
chunk at a fixed N whatever the step's decodes; here N follows them: a step with D
decodes cuts each prompt's chunk at

    P(D) = (R - 1) * t_dec(D) / c,   so that   t_dec(D) + c * P(D) = R * t_dec(D),

with ``c`` the seconds per prompt token fitted through the origin: a mixed step's fixed
cost is then spread over its tokens, which overstates ``c`` for short chunks but is exact
where the cap binds (P = P(D)), so a closed loop settles where steps with one capped chunk
take R x t_dec(D). Few decodes (moderate load: short decode steps) make the cap tight;
many (a saturated server: long decode steps) make it loose. Like the threshold it cuts
each prompt, not the step's total: the budget a cut prompt leaves goes to the prompts
queued behind it, so a short prompt does not wait behind a long one (a total cap came out
worse in a step-time model of ShareGPT at rate 8 and inf: commit history). No cap without
decodes, before ``MIN_DECODE_STEPS`` decode-only and ``MIN_MIXED_STEPS`` mixed steps are
fitted, or where prompt tokens were measured to cost nothing; never under
``min_tokens`` (a sixteenth of the step budget), so prompts always progress.
"""

from __future__ import annotations

from vllm.config import check_mixed_step_ratio

DECODE_DECAY = 0.99  # per decode-only step: ~100 steps of memory
MIXED_DECAY = 0.95  # per mixed step: ~20 steps
MIN_DECODE_STEPS = 4
MIN_MIXED_STEPS = 2


class _Fit:
    """Exponentially weighted sums of (x, y) for a least-squares line."""

    def __init__(self, decay: float):
        self.decay = decay
        self.w = self.x = self.y = self.xx = self.xy = 0.0
        self.n = 0  # steps added

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.n += 1
        self.w = d * self.w + 1.0
        self.x = d * self.x + x
        self.y = d * self.y + y
        self.xx = d * self.xx + x * x
        self.xy = d * self.xy + x * y

    def line(self, min_var: float) -> tuple[float, float] | None:
        """(intercept, slope >= 0) of y on x; None where x's variance is under
        ``min_var`` (the slope would be noise)."""
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var < min_var:
            return None
        slope = max((self.xy / self.w - mx * my) / var, 0.0)
        return my - slope * mx, slope

    def mean(self) -> float:
        return self.y / self.w

    def through_origin(self) -> float:
        return self.xy / self.xx if self.xx > 0 else 0.0


class StepTimes:
    """The fitted step times (the module docstring); fed by the engine core each step."""

    def __init__(self):
        self.decode = _Fit(DECODE_DECAY)  # t (s) against D, decode-only steps
        self.mixed = _Fit(MIXED_DECAY)  # t - t_dec(D) (s) against P, mixed steps
        self.on_device: bool | None = None  # every time fitted was a device span

    def observe_step(self, step, out) -> None:
        """A step the core read (its ``_Dispatched``) with its ``StepOutput``."""
        if out.kernel_compiles:
            return
        device = out.device_s is not None
        self.on_device = device if self.on_device is None else self.on_device and device
        seconds = out.device_s if device else step.host_s
        self.observe(step.num_decode_tokens, step.num_prefill_tokens, seconds)

    def observe(self, num_decodes: int, num_prefill: int, seconds: float | None) -> None:
        """A step's decode rows, prompt tokens and measured time (None: not measured)."""
        if seconds is None or seconds <= 0 or num_decodes <= 0:
            return
        if num_prefill == 0:
            self.decode.add(num_decodes, seconds)
            return
        base = self.decode_time(num_decodes)
        if base is not None:
            self.mixed.add(num_prefill, seconds - base)

    def decode_time(self, num_decodes: int) -> float | None:
        """t_dec(D); None before ``MIN_DECODE_STEPS`` decode-only steps."""
        if self.decode.n < MIN_DECODE_STEPS:
            return None
        # D the same in nearly every step (an integer's variance under 1/4): its mean.
        fit = self.decode.line(0.25)
        return self.decode.mean() if fit is None else fit[0] + fit[1] * num_decodes

    def per_token(self) -> float | None:
        """c, seconds per prompt token beside decodes, through the origin; None before
        ``MIN_MIXED_STEPS`` mixed steps or where it came out <= 0."""
        if self.mixed.n < MIN_MIXED_STEPS:
            return None
        c = self.mixed.through_origin()
        return c if c > 0 else None

    def step_time(self, num_decodes: int, num_prefill: int) -> float | None:
        """A step's expected time (None: not fitted yet, or no decodes): t_dec(D), plus
        for prompt tokens the mixed fit's line (intercept and slope) where the fitted
        steps' P varied by more than a quarter of its mean, else c * P. Prompt tokens
        measured to cost nothing (c <= 0: a small model, whose mixed graphs run as fast as
        its decode graphs) add nothing: the step is then a decode step's time."""
        base = self.decode_time(num_decodes) if num_decodes > 0 else None
        if base is None or num_prefill == 0:
            return base
        if self.mixed.n < MIN_MIXED_STEPS:
            return None
        c = max(self.mixed.through_origin(), 0.0)
        mean_p = self.mixed.x / self.mixed.w
        fit = self.mixed.line((0.25 * mean_p) ** 2)
        extra = c * num_prefill if fit is None else fit[0] + fit[1] * num_prefill
        return base + max(extra, 0.0)


class MixedStepBudget:
    """``prefill_cap(D)`` for the scheduler (the module docstring), from ``times``."""

    def __init__(self, ratio: float, max_num_batched_tokens: int, times: StepTimes):
        self.ratio = check_mixed_step_ratio(ratio)
        self.min_tokens = max(1, max_num_batched_tokens // 16)
        self.times = times

    @classmethod
    def of(cls, config, times: StepTimes) -> MixedStepBudget | None:
        """The budget of an ``EngineConfig``; None where ``max_mixed_step_ratio`` is 0."""
        ratio = config.max_mixed_step_ratio
        return cls(ratio, config.max_num_batched_tokens, times) if ratio else None

    def prefill_cap(self, num_decodes: int) -> int | None:
        """The most tokens of one prompt a step with ``num_decodes`` decodes should carry;
        None: no cap (no decodes, too few steps fitted yet, or prompt tokens beside
        decodes measured to cost nothing)."""
        if num_decodes <= 0:
            return None
        base, c = self.times.decode_time(num_decodes), self.times.per_token()
        if base is None or c is None:
            return None
        return max(self.min_tokens, int((self.ratio - 1.0) * base / c))
