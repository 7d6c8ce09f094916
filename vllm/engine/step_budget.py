"""The prompt tokens a step may carry beside decodes, from the steps' measured times
(``max_mixed_step_ratio`` R, ``--max-mixed-step-ratio``; 0, the default: off).

A running request's inter-token latency is the time of the steps it decodes in. A step
that also prefills prompt tokens takes longer than a decode-only step, by about a fixed
cost per prompt token, so a long prompt arriving beside running decodes makes one long
gap in every stream: the ITL tail. ``long_prefill_token_threshold`` caps each prompt's
chunk at a fixed N whatever the step's decodes; here the cap follows them: a step with D
decodes carries at most P(D) prompt tokens, chosen so that it takes about R times the
decode-only step of D decodes,

    t_dec(D) + c * P(D) = R * t_dec(D),   so   P(D) = (R - 1) * t_dec(D) / c,

with ``t_dec(D) = a + b * D`` fitted to the decode-only steps and ``c`` (seconds per prompt
token beside decodes) to the extra time of the mixed steps over ``t_dec`` of their decodes,
both as exponentially weighted least squares over the recent steps. ``c`` is fitted
through the origin: a mixed step's fixed cost is then spread over its tokens, which
overstates ``c`` for short chunks, but at the steps the cap binds (P = P(D), where it
matters) the fit is exact, so the cap settles where those steps take R x t_dec(D). Few
decodes (moderate load) make ``t_dec`` short and the cap tight; many (a saturated server)
make it long and the cap loose, so throughput at full load is not given up for a latency
nobody sees. A step without decodes is not capped (no stream waits on it).

The cap is never under ``min_tokens`` (a sixteenth of the step budget), so prompts
always progress, and it applies only once both fits have data (``MIN_DECODE_STEPS`` decode-only
and ``MIN_MIXED_STEPS`` mixed steps): the first mixed steps run uncapped and teach ``c``.
Step times are the steps' device spans (CUDA events); where there are none (a CPU device)
the host time of the dispatch, which on a CPU device runs the forward. Steps that
compiled a kernel are not fitted.
"""

from __future__ import annotations

DECODE_DECAY = 0.99  # per decode-only step: ~100 steps of memory
MIXED_DECAY = 0.95  # per mixed step: ~20 steps
MIN_DECODE_STEPS = 4
MIN_MIXED_STEPS = 2


def check_ratio(ratio) -> float:
    """``max_mixed_step_ratio`` as a float, or ValueError naming the field: 0 (off) or
    >= 1 (1: a mixed step as long as a decode step, so every cap is ``min_tokens``)."""
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or ratio != ratio:
        raise ValueError(f"max_mixed_step_ratio must be a number, got {ratio!r}")
    if ratio != 0 and not 1 <= ratio < float("inf"):
        raise ValueError(
            f"max_mixed_step_ratio must be 0 (off) or a finite number >= 1 (a step with "
            f"prompt tokens beside decodes takes at most that many times a decode-only "
            f"step), got {ratio!r}"
        )
    return float(ratio)


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

    def line(self) -> tuple[float, float]:
        """(intercept, slope >= 0) of y on x; slope 0 where x barely varied."""
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var < 0.25:  # D (an integer) the same in nearly every step: t_dec is its mean
            return my, 0.0
        slope = max((self.xy / self.w - mx * my) / var, 0.0)
        return my - slope * mx, slope

    def through_origin(self) -> float:
        return self.xy / self.xx if self.xx > 0 else 0.0


class MixedStepBudget:
    """``prefill_cap(D)`` for the scheduler, ``observe`` for the engine core (above)."""

    def __init__(self, ratio: float, max_num_batched_tokens: int):
        self.ratio = check_ratio(ratio)
        self.min_tokens = max(1, max_num_batched_tokens // 16)
        self.decode = _Fit(DECODE_DECAY)  # t (s) against D, decode-only steps
        self.mixed = _Fit(MIXED_DECAY)  # t - t_dec(D) (s) against P, mixed steps
        self.num_capped_steps = 0  # steps whose prompt tokens the cap cut (the scheduler)

    @classmethod
    def of(cls, config) -> MixedStepBudget | None:
        """The budget of an ``EngineConfig``; None where ``max_mixed_step_ratio`` is 0."""
        ratio = config.max_mixed_step_ratio
        return cls(ratio, config.max_num_batched_tokens) if ratio else None

    def decode_time(self, num_decodes: int) -> float | None:
        if self.decode.n < MIN_DECODE_STEPS:
            return None
        a, b = self.decode.line()
        return a + b * num_decodes

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

    def observe_step(self, step, out) -> None:
        """``observe`` a step the core read (its ``_Dispatched``) with its ``StepOutput``."""
        if not out.kernel_compiles:
            seconds = out.device_s if out.device_s is not None else step.host_s
            self.observe(step.num_decode_tokens, step.num_prefill_tokens, seconds)

    def prefill_cap(self, num_decodes: int) -> int | None:
        """The most prompt tokens a step with ``num_decodes`` decodes should carry; None:
        no cap (no decodes, or the fits have too few steps yet, or prompt tokens beside
        decodes were measured to cost nothing)."""
        if num_decodes <= 0 or self.mixed.n < MIN_MIXED_STEPS:
            return None
        base = self.decode_time(num_decodes)
        per_token = self.mixed.through_origin()
        if base is None or per_token <= 0:
            return None
        return max(self.min_tokens, int((self.ratio - 1.0) * base / per_token))
