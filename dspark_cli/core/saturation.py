"""Saturation policy: stop paying for the draft pass while verification does not pay, and probe to come back.

The capacity manager (:mod:`dspark_cli.core.capacity`) chooses how many drafts a step verifies; this module
decides whether a step drafts at all. Its parts, lowest first:

* ``RequestWeightedMean``: the windowed mean every estimate here uses (forgetting by request-steps);
* ``StepTimeCalibration``: measured over priced step time, drafting and plain steps apart, per load -- how
  much more (or less) a drafting step really costs against plain decoding than the curve says;
* ``SaturationPolicy``: pause after ``patience`` losing steps, resume only through a probe that pays (timer,
  load fall, load rise), the probe tax; ``SaturationCounters`` and ``ProbeVerdict`` say what it did;
* ``StepTimer``: the engine-facing pair of the two, for engines that time their steps (plain samples while
  drafting, the kind each step began as, the cost scale a verdict uses).

Why a separate module: the policy is engine-agnostic and judges steps by their outcome and measured time,
not by confidences; engines drive it through ``CapacityManager`` (embedded) or directly (vLLM's manager).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from dspark_cli.core.checks import check_float, check_int, check_probe_tax

if TYPE_CHECKING:
    from dspark_cli.core.capacity import BudgetDecision, CapacityConfig


# CapacityManager.record_outcome: the realized gain is averaged over ~REALIZED_MEMORY request-steps (4 steps
# at 16 requests, one at 64+, ~64 at one request) -- enough to ride out acceptance noise without letting a
# miscalibrated head draft at a loss for long; a probe drafts for at least PROBE_REQUEST_STEPS request-steps.
REALIZED_MEMORY = 64
# Step-time calibration (StepTimeCalibration): request-steps in each window, how far one sample may pull,
# and how often a drafting engine takes one plain step just to measure plain decoding.
STEP_TIME_MEMORY = 256
STEP_TIME_CLAMP = 4.0
# An engine that times a step as the interval between two decisions (vLLM's manager) builds its StepTimer with
# tax_clamp=PROBE_TAX_CLAMP, so the probe tax counts at most that many times a step's price: a probe's catch-up over
# a long pause runs ~4.4x (H100, section 36), an interval the server idled through any length. One that times the
# step itself (the embedded engine) counts it whole: its probe's catch-up is all work the probe cost.
PROBE_TAX_CLAMP = 2 * STEP_TIME_CLAMP
PLAIN_SAMPLE_EVERY = 64
# A window not fed for more than STEP_TIME_STALE timed steps (all loads and kinds) restarts with its next sample,
# and a drafting step at a load whose plain window is that old takes a plain step to measure it: times from
# another phase of serving (a warm-up, another wave's heavier steps in the same bucket) say nothing about now.
# Twice the plain sampling interval, so steady drafting at one load keeps averaging its plain samples.
STEP_TIME_STALE = 2 * PLAIN_SAMPLE_EVERY
PROBE_REQUEST_STEPS = 16
# ... or for PROBE_MAX_STEPS steps at low load, whichever comes first: a small model's step costs the same at
# 2 requests as at 16, and a lucky verdict at low load only drafts until the batch refills.
PROBE_MAX_STEPS = 4
# SaturationPolicy: a load at or below this fraction of the lowest unprofitable one is probed at once, and
# so is one at or above LOAD_RISE times the highest.
LOAD_FALL = 0.75
LOAD_RISE = 4 / 3
# ... once the load has settled: grown by less than LOAD_SETTLE_RISE over the last LOAD_SETTLE_STEPS steps (a
# ramp's loads are ones the batch is leaving; SaturationPolicy).
LOAD_SETTLE_STEPS = 4
LOAD_SETTLE_RISE = 1.05
# SaturationPolicy's probe tax, for engines that time their steps: probes (and the drafting steps of a resume
# until it is confirmed) may spend at most PROBE_TAX of the paused steps' wall time at their load (power-of-two
# buckets, as StepTimeCalibration's); each load's allowance is capped at PROBE_BANK of its probes' worth, so a
# long pause cannot fund a burst of probes.
PROBE_TAX = 0.02
PROBE_BANK = 4
# A due probe waits (at most PROBE_MEASURE_WAIT paused steps) until a paused step at its load has been timed:
# judged without one, a drafting step there is priced by another load's quotient (SaturationPolicy).
PROBE_MEASURE_WAIT = 16
PROBE_TRIGGERS: tuple[str, ...] = ("timer", "load", "rise")  # "load": the load fell; "rise": it rose
PROBE_VERDICTS: tuple[str, ...] = ("paid", "failed", "unjudged")
# A probe resumes drafting only if its realized gain clears plain decoding by this margin: a probe that
# resumes by luck costs ``patience`` losing steps, and one step of 16 requests whose mean acceptance sat 30%
# below break-even cleared 1.0 about one probe in five (a CPU replay of the real H200 setup); drafting that
# pays by less than the margin is not worth that risk.
PROBE_MARGIN = 1.05
# Drafting keeps going only while its realized gain over a longer window (SUSTAIN_MEMORY request-steps: 16 steps
# at 64 requests, 64 at 16) clears plain decoding by SUSTAIN_MARGIN (SaturationPolicy, "Break-even drafting").
# The short window judges each step against 1.0 and rides out noise; it cannot see drafting that sits at break-even,
# whose losing and paying steps alternate so that no run of ``patience`` losing steps comes. What the step's
# verdict does not price makes break-even drafting a loss: requests that advance unevenly finish apart, and their
# successors arrive one by one, each admitted in a mixed step that drafts nothing, with a catch-up after it. On an
# H100 (Llama-3-8B shape, 64 requests, docs/PERFORMANCE.md section 48) drafting judged at about 1.0 ran the whole
# cell, 144 mixed steps against no speculation's 45, and lost 7.4% to it. Below PROBE_MARGIN, so that a resume
# has room before the rule can pause it again.
SUSTAIN_MARGIN = 0.03
SUSTAIN_MEMORY = 1024
# A failed timer probe backs the timer off by 2 / realized (realized: its Θ over plain decoding's, after the
# margin), between 2 and PROBE_BACKOFF_MAX_GROWTH: one just short of break-even waits twice as long, one that
# realized half of plain decoding four times. Drafting that realizes half of what plain decoding does needs its
# acceptance to nearly double before it pays, which a few dozen paused steps rarely bring; doubling after every
# such probe spent the first ~500 paused steps at a load on five probes (an H100, SmolLM2-135M at 16 requests:
# 0.40-0.66x each, 14 ms against a paused step's 3.4 ms, 3% of the cell; docs/PERFORMANCE.md section 45).
PROBE_BACKOFF_MAX_GROWTH = 4.0


def _backoff_growth(realized: float | None) -> float:
    """How much a failed timer probe grows the wait: 2 / realized, between 2 and ``PROBE_BACKOFF_MAX_GROWTH``; 2
    where no distance is known (a verdict given as a bool)."""
    if realized is None or not realized > 0:
        return 2.0
    return min(PROBE_BACKOFF_MAX_GROWTH, max(2.0, 2.0 / realized))


class RequestWeightedMean:
    """Mean of recent per-step values, each weighted by its step's requests, forgetting by request-steps.

    A step of R requests decays the past by ``(1 - 1/memory) ** R`` and adds its value with weight R: one
    full batch is solid evidence, one step of a single request is noise. ``value`` is None before any step.
    """

    def __init__(self, memory: int) -> None:
        check_int("memory", memory, 1)
        self.memory = memory
        self._w = 0.0
        self._x = 0.0

    def add(self, value: float, num_reqs: int) -> None:
        r = max(1, int(num_reqs))
        decay = (1.0 - 1.0 / self.memory) ** r
        self._w = decay * self._w + r
        self._x = decay * self._x + r * value

    @property
    def value(self) -> float | None:
        return self._x / self._w if self._w > 0 else None


class StepTimeCalibration:
    """Measured over priced step time, for drafting and for plain steps apart, per load.

    The saturation policy judges a drafting step by its tokens per *priced* millisecond against plain
    decoding's priced Θ, so it inherits any error of the curve in the price of drafting relative to plain
    decoding -- and such errors are real: a curve profiled with greedy drafting prices a sampling batch's
    draft pass at 0.6x its cost (H200, 128k vocabulary), and host work a profile does not see (per-request
    sampling state, stalls) lands on drafting steps. Engines that time their steps report each one here;
    the quotient of the two windows (``relative_draft_cost``) rescales what a drafting step really cost
    against plain decoding.

    Why per load (power-of-two buckets of the request count): the error is not one factor. Host work per
    request that the curve does not price (sampling state, emission, the server's streaming) is a small part
    of a step at 16 requests and a large one at 256. A window remembers ``STEP_TIME_MEMORY`` request-steps,
    so a single 256-request step outweighs all it held before. One window over all loads therefore judged a
    light load after a heavy phase mostly by the heavy load's quotient. On an H200 (SmolLM2-135M, section 12
    of docs/PERFORMANCE.md) that coincided with drafting at 16 requests every step at about 0.6x the
    throughput of plain decoding. A load is judged by its own bucket.

    A load whose bucket has plain steps but no drafting ones -- a pause at a load drafting never ran at, the
    case of every probe there -- is judged by what its plain steps show: the time they take beyond their price
    is taken to be per step (server and scheduler work, streaming), so a drafting step there is priced at its
    curve price plus that excess. Not another load's quotient: where the draft pass is host-bound (at light
    load) drafting steps cost 2-3x their price relative to plain ones, and at heavy load, where the GPU is the
    bottleneck, less than 1x; borrowed across that range, a light load's quotient made every probe at 256
    requests fail where drafting paid (docs/PERFORMANCE.md section 18). Only a bucket with neither kind borrows
    the nearest bucket's quotient, and only where that errs on its own side: a lighter load's quotient above 1
    overstates drafting's cost at a heavier one, and a heavier load's below 1 understates it at a lighter one,
    so either is replaced by 1 (the curve's own judgment). On the H200 (vLLM, section 27) a probe at 256
    requests that found no decode step timed at its load borrowed 16-31 requests' 1.5-1.9 and failed, where
    verifying everything led no speculation by 27%.

    Request-weighted windows of ``STEP_TIME_MEMORY`` request-steps; a sample's ratio is clamped to
    ``[1/STEP_TIME_CLAMP, STEP_TIME_CLAMP]`` so one compile stall cannot swing a window. With nothing measured
    the scale is 1 (the curve's own judgment).

    Why windows go stale (``STEP_TIME_STALE``): a window forgets only by its own samples, and a bucket's plain
    window is fed by paused steps at its load, or by one plain step per ``PLAIN_SAMPLE_EVERY`` while drafting
    runs there. Once drafting resumed at a load, its drafting window was fresh after a step or two while its
    plain window still held what paused steps had measured long before. On an H200 (mask + SPS at 128 requests,
    docs/PERFORMANCE.md section 22) the 128-255 bucket's quotient read 0.37 from the first cell on, set by the
    shape warm-up (plain steps near 256 requests ran 2.7x their price, at 128 1.4x): drafting looked ~2.4x
    cheaper than it was, each step paid on paper, and one plain sample per 64 steps, blended with that history,
    took two samples to undo it -- 128-132 drafting steps at ~0.6x plain decoding. A window whose last sample
    is more than ``STEP_TIME_STALE`` timed steps old therefore restarts with its next one, and
    :meth:`plain_is_stale` tells :class:`StepTimer` to measure such a load's plain steps before trusting its
    quotient.
    """

    def __init__(self, memory: int = STEP_TIME_MEMORY) -> None:
        check_int("memory", memory, 1)
        self.memory = memory
        self._windows: dict[tuple[bool, int], RequestWeightedMean] = {}
        self.num_samples = {True: 0, False: 0}
        self._clock = 0  # timed steps recorded, all loads and kinds
        self._fed_at: dict[tuple[bool, int], int] = {}  # the clock at each window's latest sample

    @staticmethod
    def load_bucket(num_reqs: int) -> int:
        """Bucket b holds request counts in ``[2**(b-1), 2**b)``: 1, 2-3, 4-7, ..., 256-511."""
        return max(1, int(num_reqs)).bit_length()

    @staticmethod
    def bucket_label(bucket: int) -> str:
        """The request counts of a load bucket: "1", "2-3", ..., "256-511"."""
        lo, hi = 1 << (bucket - 1), (1 << bucket) - 1
        return str(lo) if lo == hi else f"{lo}-{hi}"

    def record(self, drafting: bool, num_reqs: int, measured_ms: float, priced_ms: float) -> None:
        if not (measured_ms > 0 and priced_ms > 0 and math.isfinite(measured_ms) and math.isfinite(priced_ms)):
            return
        ratio = min(max(measured_ms / priced_ms, 1.0 / STEP_TIME_CLAMP), STEP_TIME_CLAMP)
        key = (drafting, self.load_bucket(num_reqs))
        window = self._windows.get(key)
        if window is None or self._age(key) > STEP_TIME_STALE:
            window = self._windows[key] = RequestWeightedMean(self.memory)  # a stale history is dropped, not blended
        self._clock += 1
        self._fed_at[key] = self._clock
        window.add(ratio, num_reqs)
        self.num_samples[drafting] += 1

    def _age(self, key: tuple[bool, int]) -> int:
        return self._clock - self._fed_at.get(key, self._clock)

    def _plain_current(self, num_reqs: int) -> bool:
        """Whether ``num_reqs``'s load bucket has plain steps timed within the last ``STEP_TIME_STALE`` timed steps."""
        key = (False, self.load_bucket(num_reqs))
        return key in self._windows and self._age(key) <= STEP_TIME_STALE

    def plain_is_stale(self, num_reqs: int) -> bool:
        """Whether ``num_reqs``'s load bucket has plain steps measured, but none in the last ``STEP_TIME_STALE``
        timed steps (a bucket never measured is not stale: it has no history to mislead)."""
        return (False, self.load_bucket(num_reqs)) in self._windows and not self._plain_current(num_reqs)

    def plain_is_unknown(self, num_reqs: int) -> bool:
        """Whether ``num_reqs``'s load bucket lacks a current plain window: never measured, or stale
        (:meth:`plain_is_stale`). Drafting there is judged by a borrowed quotient or the curve alone until a
        plain step at the load is timed."""
        return not self._plain_current(num_reqs)

    def times_load(self, num_reqs: int) -> bool:
        """Whether a drafting step at ``num_reqs`` would be judged by that load's own measurements: its bucket
        has plain steps timed within ``STEP_TIME_STALE`` timed steps -- or nothing has been timed at all (the
        curve judges alone; nothing would be borrowed)."""
        return not (self.num_samples[True] or self.num_samples[False]) or self._plain_current(num_reqs)

    def ratio(self, drafting: bool, num_reqs: int) -> float | None:
        """Windowed measured / priced time of drafting (True) or plain (False) steps at ``num_reqs``'s load
        bucket; None before a sample there."""
        window = self._windows.get((drafting, self.load_bucket(num_reqs)))
        return None if window is None else window.value

    def ratios(self, drafting: bool) -> dict[int, float]:
        """Windowed measured / priced time of drafting (True) or plain (False) steps, per load bucket measured."""
        return {b: w.value for (d, b), w in sorted(self._windows.items()) if d == drafting and w.value is not None}

    def quotients(self) -> dict[int, float]:
        """Drafting over plain measured/priced quotient of every load bucket holding both kinds of steps, its
        drafting steps timed within the last ``STEP_TIME_STALE`` timed steps.

        A drafting window is fed only while drafting runs, so through a pause it keeps what drafting cost before
        it, however long ago. On an H100 (docs/PERFORMANCE.md section 35) the shape warm-up's first drafting
        steps at 32 requests read 1.44 (their first-use costs; drafting at that load measured 1.05 on a twin
        server), the policy paused on it, and every probe at 32 requests was judged by it for the rest of the
        run: all failed, where drafting paid 5%. A stale drafting window judges nothing; a probe there is
        judged as at a load drafting never ran at (:meth:`relative_draft_cost`)."""
        plain = self.ratios(False)
        return {b: min(max(d / plain[b], 1.0 / STEP_TIME_CLAMP), STEP_TIME_CLAMP)
                for b, d in self.ratios(True).items() if b in plain and self._age((True, b)) <= STEP_TIME_STALE}

    def relative_draft_cost(self, num_reqs: int, drafting_ms: float = 0.0, plain_ms: float = 0.0) -> float:
        """How much more (> 1) or less a drafting step of ``num_reqs`` requests really costs, relative to
        plain decoding, than priced: its load bucket's quotient; else, given the step's priced drafting and
        plain times and plain steps measured at its load, the per-step excess prior (class docstring); else
        the nearest bucket's quotient (ties go to the lower load) where it errs on its own side, 1 where not;
        else 1."""
        quotients = self.quotients()
        own = self.load_bucket(num_reqs)
        if own in quotients:
            return quotients[own]
        plain = self.ratio(False, num_reqs)
        if plain is not None and drafting_ms > 0 and plain_ms > 0:
            measured = drafting_ms + (plain - 1.0) * plain_ms  # its price plus the plain steps' excess
            return min(max(measured / drafting_ms / plain, 1.0 / STEP_TIME_CLAMP), STEP_TIME_CLAMP)
        if not quotients:
            return 1.0
        nearest = min(quotients, key=lambda b: (abs(b - own), b))
        borrowed = quotients[nearest]
        if (nearest < own and borrowed > 1.0) or (nearest > own and borrowed < 1.0):
            return 1.0  # against its load's bias (class docstring): no better than the curve's own judgment
        return borrowed


class StepTimer:
    """Measured step times for the saturation policy, in engines that time their steps.

    Two consumers: the policy's probe tax (:meth:`SaturationPolicy.record_step_ms`, every step) and
    :class:`StepTimeCalibration` (drafting against plain steps, per load), whose quotient rescales what a
    drafting step cost when the policy judges its outcome (:meth:`cost_scale`). While drafting stays on,
    :meth:`begin_step` turns one step in ``PLAIN_SAMPLE_EVERY`` timed drafting steps into a plain one, so
    the quotient has a plain measurement to compare against (one plain step in 65 costs a paying
    configuration well under 1%). Probe steps are left out of the calibration: they are not what drafting
    costs once it runs. A probe catches the draft up over the whole pause, and on vLLM (Llama-3-8B shape,
    H200, docs/PERFORMANCE.md section 18) the quotients that probes measured were about twice what steady
    drafting cost against paused steps at 16, 64 and 256 requests, so every probe failed, including those at
    256 where drafting paid by 21%. A pause therefore judges its probes by the plain steps' excess at their
    load (:meth:`StepTimeCalibration.relative_draft_cost`). Steps that carried other work than their own
    (vLLM's paused ``draft_model`` draft catching up) are recorded with ``calibrate=False``.

    What a "plain" step is depends on the engine, and that is the point: the embedded engine's paused step
    is plain decoding, while vLLM's paused ``draft_model`` step still costs more (on the H200's Llama-3-8B
    shape at 64 requests, in-process, 6.84 ms against 6.31 ms with no speculation after the draft's prefill
    pass was deferred, 7.1 ms before; docs/PERFORMANCE.md sections 15 and 16). The quotient then compares
    drafting against what pausing really costs there, not against the curve's price of plain decoding.
    """

    def __init__(self, saturation: SaturationPolicy, tax_clamp: float | None = None) -> None:
        self.saturation = saturation
        self.tax_clamp = tax_clamp  # PROBE_TAX_CLAMP where a step's time may hold idle time; None: counted whole
        self.step_times = StepTimeCalibration()
        self._drafting_since_plain = 0  # drafting steps (probes aside) begun since the last plain one
        self._plain_in_flight = False  # a plain step was begun and its time has not come back yet
        self._plain_untimed = False  # the last plain step could not be timed (it carried other work)
        self._reported = False  # the engine has reported a step time: it times its steps

    @property
    def probe_step(self) -> bool:
        """The step begun last drafts as a saturation probe."""
        return self.saturation.step_kind == "probe"

    def begin_step(self, num_running: int) -> bool:
        """Whether this step drafts: the policy's verdict, or a plain sample once drafting has run
        ``PLAIN_SAMPLE_EVERY`` timed steps, or at once (after one drafting step, so never two plain samples in a
        row) where the load has no current plain window (:meth:`StepTimeCalibration.plain_is_unknown`):

        * stale: drafting just resumed, or moved, to a load whose plain steps were last timed in another phase
          of serving, and its quotient would compare fresh drafting steps with them for ``PLAIN_SAMPLE_EVERY``
          steps;
        * never measured: a server that starts drafting at a load has only the curve (or a borrowed quotient)
          to judge it by until its first plain sample there. On the H200 (vLLM, Llama-3-8B shape, 256 requests,
          docs/PERFORMANCE.md section 30) the curve said drafting paid by 8% where it ran at about half plain
          decoding's pace, and a fresh server drafted ~90 steps at 256 requests before it paused: 12% of its
          first cell. One plain step settles it.

        Pointless where drafting never pauses (patience 0).

        Counted here, as steps are begun, not as their times come back: an engine may report a step's time a
        step or two late (vLLM on CUDA reads it between stream events, engines/vllm/step_clock.py), and until
        then a sample's load still looks unknown -- counted at its record, every such step would have been
        another plain sample. A plain step whose time is still on its way is as good as taken. An engine that
        has reported no step time gets no plain sample: it would measure nothing."""
        drafting = self.saturation.begin_step(num_running, self.step_times.times_load(num_running))
        if (drafting and not self.probe_step and self.saturation.patience > 0 and self._reported
                and (self._drafting_since_plain >= PLAIN_SAMPLE_EVERY
                     or (self._drafting_since_plain > 0 and not self._plain_untimed and not self._plain_in_flight
                         and self.step_times.plain_is_unknown(num_running)))):
            drafting = False
        if not drafting:
            # Also ends the run when the step cannot be timed: else every step after an untimed plain sample
            # was another one until a timed one came, and where no step at a load is timed (section 27's
            # prefill rule at 256 requests) drafting never ran there again.
            self._drafting_since_plain = 0
            self._plain_in_flight = True
        elif not self.probe_step:
            self._drafting_since_plain += 1
        return drafting

    def record(self, drafting: bool, num_reqs: int, measured_ms: float, priced_ms: float,
               calibrate: bool = True, charge: StepCharge | None = None) -> None:
        """A step's measured wall time and what the curve charged for it. ``calibrate=False``: the step did
        work that is neither drafting's nor a paused step's cost (a draft catching up over a pause); it counts
        for the probe tax only. ``charge``: :attr:`SaturationPolicy.step_charge` as the step began; None for the
        step begun last (an engine that reports each step before beginning the next). With ``tax_clamp`` the
        probe tax counts at most that many times the price: a catch-up was spent, an interval a server idled
        through was not."""
        charge = self.saturation.step_charge if charge is None else charge
        kind = charge.kind
        clamp = self.tax_clamp
        taxed = min(measured_ms, clamp * priced_ms) if clamp is not None and priced_ms > 0 else measured_ms
        self.saturation.record_step_ms(drafting, taxed, kind, num_reqs, charge.trigger, charge.probe_bucket)
        self._reported = True
        if not drafting:
            self._plain_in_flight = False
            # An untimed one stops a stale window from asking for a plain sample at once (begin_step): that would
            # alternate plain and drafting steps for as long as the load's steps cannot be timed.
            self._plain_untimed = not calibrate
        if not calibrate:
            return
        if drafting and kind == "probe":
            return
        self.step_times.record(drafting, num_reqs, measured_ms, priced_ms)

    def cost_scale(self, num_running: int, decision: BudgetDecision) -> float:
        """What to pass :meth:`SaturationPolicy.observe_outcome` for a step of ``num_running`` requests priced
        by ``decision`` (its drafting and plain prices inform a load whose drafting was never measured)."""
        return self.step_times.relative_draft_cost(num_running, decision.step_ms, decision.plain_ms)


class StepCharge(NamedTuple):
    """What a step is to the probe tax as it begins (:attr:`SaturationPolicy.step_charge`): its kind, the trigger
    of the probe in progress or the last, and that probe's load bucket. An engine that learns a step's time steps
    later keeps this with the step and reports the time with it."""

    kind: str
    trigger: str
    probe_bucket: int


@dataclass
class ProbeAllowance:
    """The probe tax's account at one load bucket: what is left to spend (ms), and its mean probe step (ms;
    None before the bucket's first probe, which finds the account full)."""

    allowance_ms: float = 0.0
    probe_step_ms: float | None = None


@dataclass
class SaturationCounters:
    """What the saturation policy did, cumulative (engines export them as ``dspark:saturation_*`` counters).

    ``probes`` holds every (trigger, verdict) pair from the start (``PROBE_TRIGGERS`` x ``PROBE_VERDICTS``), so
    a reader on another thread can copy it while the engine counts. ``deferred_probe_steps``: paused steps on
    which a probe was due but the probe tax held it back; ``unmeasured_probe_steps``: those on which it waited
    for a paused step at its load to be timed; ``rising_probe_steps``: paused steps on which a probe would have
    been due but the load was still rising (past the rise threshold, or climbing under a load-fall or timer
    probe), so none was.
    """

    pauses: int = 0
    resumes: int = 0
    probe_steps: int = 0
    deferred_probe_steps: int = 0
    unmeasured_probe_steps: int = 0
    rising_probe_steps: int = 0
    scout_steps: int = 0  # probe steps that scouted (probe_scout): counted in probe_steps too
    unsustained_steps: int = 0  # drafting steps that paid on the short window but not on the sustained one
    probes: dict[tuple[str, str], int] = field(
        default_factory=lambda: {(t, v): 0 for t in PROBE_TRIGGERS for v in PROBE_VERDICTS})
    last_probe: ProbeVerdict | None = None  # the evidence of the latest judged probe


@dataclass(frozen=True)
class ProbeVerdict:
    """Why the latest probe paid or failed: what a server's log needs to tell a wrong verdict from a right one.

    ``realized``: the probe's Θ over plain decoding's, after ``PROBE_MARGIN`` (it pays at >= 1, and only if
    ``predicted`` -- the budget decision said drafting pays too); ``cost_scale``: the measured drafting-step
    quotient the verdict used (``StepTimeCalibration``).
    """

    trigger: str
    num_running: int
    realized: float
    predicted: bool
    cost_scale: float
    drafted: int | None = None  # a sampled probe's drafting requests (CapacityManager.probe_sample_size); None: all

    def describe(self) -> str:
        verdict = "paid" if self.predicted and self.realized >= 1.0 else "failed"
        sample = "" if self.drafted is None else f" ({self.drafted} drafting)"
        return (f"{self.trigger} probe at {self.num_running} requests{sample} {verdict}: realized {self.realized:.2f}x "
                f"plain decoding at cost scale {self.cost_scale:.2f}, predicted "
                f"{'to pay' if self.predicted else 'no gain'}")


class SaturationPolicy:
    """Stop paying for the draft pass while verification does not pay, and probe to come back.

    A step *does not pay* when its budget is 0 or Θ at the chosen budget is no better than plain decoding
    (``BudgetDecision.pays`` is False). After ``patience`` consecutive such steps drafting pauses
    (``drafting_enabled`` False: engines skip the draft pass and decode one token per request).

    Resume rule, checked by :meth:`begin_step` at the start of every step while paused. Every resume goes
    through a *probe*: drafting steps until ``PROBE_REQUEST_STEPS`` request-steps are seen (at most
    ``PROBE_MAX_STEPS`` steps), judged on their own outcome, which must beat plain decoding by
    ``PROBE_MARGIN``; if it pays, drafting resumes, otherwise the pause continues.

    * **timer**: after ``probe_wait`` paused steps (``resume_every``, grown by every failed timer probe --
      doubled, or up to quadrupled for a probe judged on its outcome that fell far short of break-even
      (``PROBE_BACKOFF_MAX_GROWTH``) -- up to ``MAX_PROBE_BACKOFF x resume_every``; a resume that pauses again
      within ``2 x patience`` drafting steps was a false positive and doubles it too, instead of starting
      over). A probe costs a whole speculative step plus the draft's catch-up over the pause, so under
      sustained saturation fixed-rate probes would tax throughput by ~1/resume_every forever; the backoff bounds that tax at
      1/(MAX_PROBE_BACKOFF x resume_every). The backoff is what timer probes failed at their load: once the
      load has held within ``LOAD_SETTLE_RISE`` (or one request) for ``resume_every`` paused steps, at or below
      ``LOAD_FALL`` of the load where the last timer probe failed, the wait goes back to ``resume_every``, or
      to what failures at this load's power-of-two bucket had backed it off to; and a load back in a bucket
      whose timer probes failed gets the wait they earned there back (a closed loop's refill after its
      drain). On an H100 (docs/PERFORMANCE.md section 36) a shape warm-up's timer probes failed at 124-256
      requests and backed the wait off to 256 paused steps before a 16-request cell where drafting paid
      1.1-1.3x. A draining batch, a straggler tail
      shorter than that wait, or a full batch losing a request or two is no such load, and keeps the backoff.
      A pause that starts backed off (a resume lost within its probation, a ceiling the load came back to) was
      backed off at its load, as a failed timer probe's wait is, and resets alike.
    * **load fell**: when the number of running requests falls to <= 3/4 of the lowest load at which
      drafting has been found not to pay (the load that paused it, or a failed probe's), a probe runs at
      once: the contention that made drafting unprofitable may be gone. A failed one lowers that floor to
      its own load and leaves the timer alone. If one pays, drafting resumes with a *ceiling*: once the
      load is back at the one that paused drafting, drafting pauses again at once, with the probe wait it
      had (not after ``patience`` more losing steps). So does a timer probe that pays below the load that
      paused drafting (a batch draining between the timer's probes): on the H200 (vLLM, docs/PERFORMANCE.md
      section 27) one paid at 11 requests at the end of a 16-request cell, and the next cell's ramp to 64
      requests began drafting. A probe that pays below a heavier load found losing in the pause (a failed
      rise probe's) makes that load the ceiling; one that pays at or above every such load clears it. The
      re-pause keeps what the pause before had found -- its floor, its top, and where its backoff was
      earned -- and not the load the batch came back at, which was never judged: a rise probe may still
      find drafting paying there. A refill before a low-load probe has its evidence ends that probe
      unjudged.
    * **climbing**: no load-fall or timer probe begins while the load climbs (it is more than
      ``LOAD_SETTLE_RISE``, and more than one request, above the lowest of the last ``LOAD_SETTLE_STEPS``
      steps); a due probe waits for it to stop. A ramp's light loads are ones the batch is leaving, and
      drafting resumed there runs the ramp with requests advancing unevenly: on an H100 (embedded engine,
      Llama-3-8B shape, 256 requests, docs/PERFORMANCE.md section 43) timer probes that came due at 12-15
      requests on a closed loop's ramp paid, and drafting ran 23-26 steps until the load was back at the
      ceiling.
    * **load rose**: when the number of running requests rises to >= 4/3 of the highest load at which
      drafting has been found not to pay (the load that paused it, or a failed probe's), a probe runs as
      soon as the load has settled (grown by less than ``LOAD_SETTLE_RISE`` over ``LOAD_SETTLE_STEPS``
      steps); a failed one raises that top to its own load and leaves the timer alone. Why settled: on a
      ramp the probe judges a load the batch is leaving. On the H200 (vLLM, Llama-3-8B shape,
      docs/PERFORMANCE.md sections 31 and 32) rise probes fired at 88-126 requests on the way to 256, where
      the curve's gain is about twice what it is at 256 and the load had no drafting measured. They paid, and
      drafting ran into 256 requests, where it lost, until patience paused it. Drafting can stop
      paying at low load and pay again at high load: a draft pass with a fixed per-step cost (vLLM's
      ``draft_model`` runs its decode passes eagerly, ~10 ms of launches at any batch size) weighs most on
      the short steps of a small batch, and verification's cost per request falls as the batch grows. On the
      H200 (Llama-3-8B shape, docs/PERFORMANCE.md section 15) drafting lost at 16 and 64 requests and won by
      26% at 256, where the timer, backed off by the failures below, never probed in a 10-second cell. A
      closed-loop refill probes at most once per new top, so a pause runs at most log_{4/3} of its load range
      of them (five from 64 requests to 256): the probe tax does not hold them back. It would, where it
      matters most: the light loads' probes spend the allowance, and a 10-second cell at 256 requests saves
      2% of ~40 ms paused steps back, about 0.8 ms a step -- a cell's length to repay one deficit of a few
      probes (docs/PERFORMANCE.md section 25: drafting paid 1.3-1.5x at 256 and never resumed).

    **Break-even drafting** (``sustain_margin``, default ``SUSTAIN_MARGIN``). A step pays when the short window
    (``REALIZED_MEMORY`` request-steps, about one step at 64 requests) clears plain decoding; drafting that sits at
    break-even alternates paying and losing steps and never loses ``patience`` in a row. Beside it a sustained
    window of ``SUSTAIN_MEMORY`` request-steps must clear plain decoding by the margin once it has seen that many
    since drafting (re)started (a resume starts it from its probe's outcome, which cleared ``PROBE_MARGIN``); short
    of it, every step counts as losing (``unsustained_steps``) and ``patience`` of them pause drafting. Its verdict
    is slow by design: at 16 requests drafting that pays 1.08x with a step's acceptance noise of ~15% reads
    1.08 +- 0.013 there, where the short window moves by ~5%. The margin covers what a step's verdict does not
    price: in a closed loop requests that advance unevenly finish apart, and each successor is admitted in a mixed
    step that drafts nothing, followed by the draft's catch-up (``SUSTAIN_MARGIN``). A margin of 0 keeps only the
    short window's verdict.

    **A probe waits for its load to be timed** (engines that time their steps: ``begin_step(measured=...)``).
    Its verdict prices a drafting step by the load's own measurements (:class:`StepTimeCalibration`); a load no
    paused step was timed at borrows another load's quotient, and light loads' quotients (a host-bound draft
    pass, 2-4x) fail every heavy-load probe. That is the first step at a new load, and every step of vLLM's
    ramp to it: the scheduler admits a wave's prompts over several steps, each carrying a prompt chunk before
    which the paused draft catches up, and such steps are not timed as paused ones. A rise probe fired there,
    failed on a borrowed quotient, raised the top to its load, and the next one did the same, until the top
    stood at the cell's steady load. So a due probe waits (``unmeasured_probe_steps``) until the engine has
    timed a paused step at its load, at most ``PROBE_MEASURE_WAIT`` steps.

    Why a probe and not a plain resume: under closed-loop load (a benchmark's waves, a client pool) the batch
    drains and refills every generation; where drafting pays at no load (a slow draft, low acceptance at
    temperature 1) an unconditional resume paid ``patience`` losing drafting steps per refill and reset the
    backoff, which on a 135M pair cost up to a quarter of the throughput of plain decoding.

    **Probe tax** (engines that report step times through :meth:`record_step_ms`). Counting probes in steps
    is not enough where a probe costs several plain steps: a probe's draft pass catches up over the whole
    pause, and at low load a step costs as much as a full one. On an H200 (SmolLM2-135M at 16 requests,
    temperature 1; docs/PERFORMANCE.md section 13) a probe took 22 ms against 5 ms for a paused step, and a
    1,000-step cell whose step-counted probes drafted 255 request-steps ran 23% below plain decoding; on
    the time allowance the same cell took 3 probe steps. Every paused step saves ``probe_tax`` (default
    ``PROBE_TAX``) of its wall time (at most ``PROBE_BANK`` probes' worth is kept; it starts full, at the
    first probe's cost), and probe steps -- and
    the drafting steps of a resume until it has lasted ``2 x patience`` steps, the window in which a lucky
    probe shows itself -- spend their whole wall time from it. A due timer probe waits while the allowance is
    negative, so timer probing costs at most ``PROBE_BANK`` probes plus about ``probe_tax`` of paused time.
    Load-fall and rise probes (and the probation of a resume they made) neither wait on the allowance nor
    spend from it: each lowers the floor or raises the top by a quarter or a third of the load, so a pause holds
    a few dozen at most, and a debt they ran up at a heavy load silenced a light one (paused steps at 16
    requests repay 0.2 ms each; section 35).

    **One allowance per load** (:class:`ProbeAllowance`, power-of-two buckets of the running requests, as
    :class:`StepTimeCalibration`'s). The tax bounds what probing costs the load it probes at; one account for
    all loads let a heavy load's debt hold a light load's probes. On an H100 (Llama-3-8B shape,
    docs/PERFORMANCE.md section 36) the shape warm-up's timer probes at 124-256 requests (250 ms a step, with
    their catch-ups) left a debt that paused steps at 16 requests repay at 0.2 ms each: one server deferred 735
    of its 16-request cell's 765 steps and drafted none, another 122 before a probe that paid 1.33x. Each
    bucket keeps its own account, so a server holds at most ``PROBE_BANK`` unfunded probes per bucket (nine
    buckets up to 256 requests) and each load pays at most ``probe_tax`` of its own paused time after that.

    An engine that reports no times is never held back. ``counters`` says what happened.

    **Scouts** (``probe_scout``, varlen only). A probe's plan cannot read its own step's confidences (they depend
    on its drafts: the lossless rule of :mod:`dspark_cli.core.capacity`) and the ones before it predate the pause,
    which may have come from confidences since recovered; so a probe plans as if every draft survives and
    verifies all of them. Where drafting loses that is the dearest step there is, and it judges drafting at a
    cost it would never get: on an H100 (Llama-3-8B shape, 256 requests, docs/PERFORMANCE.md section 40) a probe
    step took ~6.7x a paused one, 5% of the cell. With scouts a probe's first step drafts and verifies nothing
    (:attr:`scouting`; its decision carries ``scout`` and is not judged): it costs a draft pass over a plain
    step, catches the draft up over the pause, and records fresh confidences, on which the next step -- the
    probe's first judged one -- plans its budget as a drafting step would. A probe scouts only where its plan is
    priced above two steps that verify nothing (``core.capacity.SCOUT_PRICE``): at a light load verification is
    nearly free, and one probe step is cheaper than two. Mask mode's uniform batch computes every draft row
    whatever is verified, where a scout would cost a probe step and judge nothing.

    ``patience == 0`` never pauses. Engines call ``begin_step`` then, on drafting steps, ``observe``.
    """

    MAX_PROBE_BACKOFF = 32

    @classmethod
    def from_config(cls, cfg: CapacityConfig) -> SaturationPolicy:
        """The policy a capacity configuration asks for (patience, probe wait, probe tax, sustain margin)."""
        return cls(cfg.saturation_patience, cfg.resume_every, cfg.probe_tax, cfg.probe_scout, cfg.sustain_margin)

    def __init__(self, patience: int, resume_every: int, probe_tax: float = PROBE_TAX,
                 probe_scout: bool = False, sustain_margin: float = SUSTAIN_MARGIN) -> None:
        check_int("saturation_patience", patience, 0)
        check_int("resume_every", resume_every, 1)
        check_probe_tax(probe_tax)
        check_float("sustain_margin", sustain_margin, 0.0, 1.0)
        self.patience = patience
        self.resume_every = resume_every
        self.probe_tax = probe_tax
        self.probe_scout = probe_scout
        self.sustain_margin = sustain_margin
        self._scout = False  # the step begun last is a probe's scout (class docstring)
        self._probe_serial = 0  # probes begun so far (probe_serial)
        self._streak = 0
        self._paused = False
        self._floor = 0  # lowest load at which drafting was found not to pay during this pause
        self._paused_at = 0  # the load that paused drafting
        # After a load probe resumed drafting: the load that had paused it, and the probe wait then. Back at
        # that load drafting pauses again at once, where it was (see begin_step).
        self._ceiling: int | None = None
        self._ceiling_wait = resume_every
        self._ceiling_floor = 0
        self._ceiling_top = 0
        # The backoff the pause before had earned: the load of its last failed timer probe and its failed waits
        self._ceiling_earned: tuple[int, dict[int, int]] = (0, {})
        self._paused_steps = 0
        self._probe_wait = resume_every
        # The backoff's reset (class docstring): the load of this pause's last failed timer probe (0: none), the
        # wait failures left at each load bucket, and the paused steps the load has held since within
        # LOAD_SETTLE_RISE (between the lowest and highest of them) and at or below LOAD_FALL of that load.
        self._timer_failed_load = 0
        self._failed_waits: dict[int, int] = {}
        self._held_steps = 0
        self._held_range = (0, 0)
        self._measure_wait = 0  # paused steps a due probe has waited for its load to be timed
        self._probing = False
        self._top = 0  # highest load at which drafting was found not to pay during this pause
        self._probe_trigger = "timer"  # what started the probe in progress (a PROBE_TRIGGERS name)
        self._probe_running = 0
        self._realized = RequestWeightedMean(REALIZED_MEMORY)  # realized Θ / Θ(plain decoding), judged steps
        # The same over SUSTAIN_MEMORY request-steps, and the request-steps it has seen since drafting (re)started
        self._sustained = RequestWeightedMean(SUSTAIN_MEMORY)
        self._sustained_requests = 0
        self._probe_tokens = 0.0  # the probe in progress: emitted tokens, priced ms, plain-decoding ms, requests
        self._probe_ms = 0.0
        self._probe_plain = 0.0
        self._probe_requests = 0
        self._probe_steps = 0
        # Drafting steps since the last resume, and the probe wait then: a resume that pauses again within a
        # few steps was a probe's false positive, and the backoff goes on from where it was (see _pause).
        self._drafting_since_resume = 0
        self._wait_at_resume: int | None = None
        # The probe tax (record_step_ms): one account per load bucket, the probe whose bucket a probation spends
        # from, whether its resume has held, the load of the step begun last, and what that step is.
        self._accounts: dict[int, ProbeAllowance] = {}
        self._probe_bucket = 0  # load bucket of the probe in progress, or of the last (its probation spends there)
        self._probation_held = False  # the resume outlasted its probation: late reports of it are not charged
        self._last_running = 0
        self._step_kind = "drafting"
        self._loads: deque[int] = deque(maxlen=LOAD_SETTLE_STEPS + 1)  # the last steps' loads, this one's last
        self.counters = SaturationCounters()

    @property
    def drafting_enabled(self) -> bool:
        return not self._paused

    @property
    def step_kind(self) -> str:
        """What the step begun last is to the probe tax: "paused", "probe", "probation" or "drafting"."""
        return self._step_kind

    @property
    def probing(self) -> bool:
        return self._probing

    @property
    def scouting(self) -> bool:
        """The step begun last begins a probe that may scout: where the plan's price says so
        (``core.capacity.choose_budget``), it drafts and verifies nothing, and its decision (``scout``) is not
        judged (class docstring)."""
        return self._scout

    @property
    def probe_serial(self) -> int:
        """How many probes have begun: an engine that judges a step's outcome steps after planning it (vLLM) keeps
        this with the plan, and an outcome planned before the probe in progress began is no evidence for it."""
        return self._probe_serial

    @property
    def probe_trigger(self) -> str:
        """What started the probe in progress, or the last one (a ``PROBE_TRIGGERS`` name)."""
        return self._probe_trigger

    @property
    def probe_bucket(self) -> int:
        """The load bucket of the probe in progress, or the last one: where its probation's steps are charged."""
        return self._probe_bucket

    @property
    def step_charge(self) -> StepCharge:
        """What the step begun last is to the probe tax (:class:`StepCharge`)."""
        return StepCharge(self._step_kind, self._probe_trigger, self._probe_bucket)

    @property
    def floor(self) -> int:
        """The lowest load at which drafting was found not to pay in this pause (0 before any pause)."""
        return self._floor

    @property
    def top(self) -> int:
        """The highest load at which drafting was found not to pay in this pause (0 before any pause)."""
        return self._top

    @property
    def ceiling(self) -> int | None:
        """After a load probe resumed drafting: the load at which drafting pauses again at once."""
        return self._ceiling

    def begin_step(self, num_running: int, measured: bool = True) -> bool:
        """Whether this step drafts (always while enabled; resumes or probes while paused). ``measured``:
        whether a paused step at this load has been timed lately (:meth:`StepTimeCalibration.times_load`); a
        due probe waits while it is False (class docstring). Engines that do not time their steps leave it."""
        was_probing = self._probing
        drafting = self._begin(num_running, measured)
        began = drafting and self._probing and not was_probing
        self._probe_serial += began
        self._scout = self.probe_scout and began
        if not drafting:
            self._step_kind = "paused"
        elif self._probing:
            self._step_kind = "probe"
            self.counters.probe_steps += 1
        else:
            self._step_kind = "probation" if self.on_probation else "drafting"
        return drafting

    def _hold_lighter_load(self, num_running: int) -> None:
        """Count a paused step toward the backoff's reset, and reset it once the lighter load has held."""
        if not (self._timer_failed_load and num_running <= LOAD_FALL * self._timer_failed_load):
            self._held_steps = 0
            return
        lo, hi = self._held_range if self._held_steps else (num_running, num_running)
        lo, hi = min(lo, num_running), max(hi, num_running)
        # The load moved (by more than one request, which at 16 is already over 5%: a request finishing every few
        # steps must not keep a light load from ever holding): the hold starts again here.
        if hi - lo > max((LOAD_SETTLE_RISE - 1.0) * lo, 1):
            self._held_steps, lo, hi = 0, num_running, num_running
        self._held_steps += 1
        self._held_range = (lo, hi)
        if self._held_steps >= self.resume_every:
            bucket = StepTimeCalibration.load_bucket(num_running)
            self._probe_wait = max(self.resume_every, self._failed_waits.get(bucket, 0))
            self._timer_failed_load = self._held_steps = 0

    def _restore_backoff(self, num_running: int) -> None:
        """Back at a load whose timer probes failed, the wait they earned there comes back.

        A lighter load that held reset it (the tail of a closed loop's wave, or the round between two
        interleaved rounds), and the batch refilled to the load where drafting had lost: on an H100
        (docs/PERFORMANCE.md section 40) every round at 256 requests then probed at 16, 32, 64... paused steps
        again, 13 timer probes in a cell where one backoff would have run 7, each verifying every draft at
        ~6.7x a paused step's time."""
        wait = self._failed_waits.get(StepTimeCalibration.load_bucket(num_running), 0)
        if wait > self._probe_wait:
            self._probe_wait = wait
            self._timer_failed_load, self._held_steps = num_running, 0

    def _backed_off_at(self, num_running: int) -> None:
        """The timer's wait is backed off at this load: what a lighter load that holds resets (class docstring)."""
        self._timer_failed_load = num_running
        self._failed_waits[StepTimeCalibration.load_bucket(num_running)] = self._probe_wait
        self._held_steps = 0

    def _settled(self) -> bool:
        """Whether the load grew by less than ``LOAD_SETTLE_RISE`` over the last ``LOAD_SETTLE_STEPS`` steps."""
        loads = self._loads
        return len(loads) == loads.maxlen and loads[-1] < LOAD_SETTLE_RISE * loads[0]

    def _climbing(self) -> bool:
        """Whether this step's load is more than ``LOAD_SETTLE_RISE`` (and more than one request) above the
        lowest of the last ``LOAD_SETTLE_STEPS`` steps'. The lowest, not the first: a ramp that follows a drain
        (a V in the window) climbs from its bottom."""
        loads = self._loads
        low = min(loads)
        return loads[-1] - low > max((LOAD_SETTLE_RISE - 1.0) * low, 1)

    def _begin(self, num_running: int, measured: bool) -> bool:
        if num_running < 1:
            return not self._paused  # an empty step: no load to probe at, nor one to remember
        self._loads.append(num_running)
        self._last_running = num_running
        if not self._paused:
            if self._ceiling is not None and num_running >= self._ceiling:
                ceiling, floor, top = self._ceiling, self._ceiling_floor, self._ceiling_top
                self._pause(num_running, self._ceiling_wait, known_load=ceiling)  # the load that did not pay is back
                # This pause knows what the one its probe ended knew: drafting lost at the ceiling and at the loads
                # found losing then, not at a heavier load the batch may have jumped to. Claimed as the top, such a
                # load would get no rise probe (4/3 of 256 requests never comes); claimed as where drafting
                # paused, a later paying probe would make it the ceiling and draft at the losing loads below it.
                self._floor, self._top = floor, max(top, ceiling)
                # and where its backoff was earned: timer probes that failed at a heavier load than the ceiling
                # (a hold between 3/4 of the two must reset it), and each bucket's wait for the next refill
                failed_load, waits = self._ceiling_earned
                for bucket, wait in waits.items():
                    self._failed_waits[bucket] = max(wait, self._failed_waits.get(bucket, 0))
                if failed_load and self._probe_wait > self.resume_every:
                    self._timer_failed_load = failed_load
                return False
            return True
        if self._probing:
            if self._probe_trigger == "load" and num_running > LOAD_FALL * self._floor:
                # The batch refilled before a low-load probe had its evidence: it cannot judge this load.
                self.counters.probes["load", "unjudged"] += 1
                self._floor = min(self._floor, self._probe_running)
                self._end_probe()
                return False
            return True  # a probe lasts until its verdict is observed (one step unless judged on outcomes)
        self._paused_steps += 1
        self._hold_lighter_load(num_running)
        self._restore_backoff(num_running)
        if num_running <= LOAD_FALL * self._floor:
            trigger = "load"
        elif self._top > 0 and num_running >= LOAD_RISE * self._top:  # 0: the pausing load was not given
            if not self._settled():
                self.counters.rising_probe_steps += 1  # still climbing: probe where it stops (class docstring)
                self._measure_wait = 0
                return False
            trigger = "rise"
        elif self._paused_steps >= self._probe_wait:
            trigger = "timer"
        else:
            self._measure_wait = 0  # no probe due: a later one waits its own steps
            return False
        if trigger != "rise" and self._climbing():
            # A ramp's light loads are ones the batch is leaving (class docstring, "climbing").
            self.counters.rising_probe_steps += 1
            self._measure_wait = 0
            return False
        if not measured and self._measure_wait < PROBE_MEASURE_WAIT:
            self._measure_wait += 1  # this paused step times the load, and the probe is judged by it
            self.counters.unmeasured_probe_steps += 1
            return False
        if trigger == "timer" and self.probe_allowance_at(num_running) < 0:
            # Due, but probing has spent its share of this load's paused time. Only timer probes wait: load-fall
            # and rise probes are bounded by the loads they lower the floor to and raise the top to (one per 4/3
            # of load), and a debt run up at a heavy load -- a shape warm-up's drain probes at 256 requests,
            # 100-240 ms a step -- took 1,300 paused steps to repay at 16 requests (0.2 ms each; section 35),
            # through two whole cells where drafting paid.
            self.counters.deferred_probe_steps += 1
            return False
        self._measure_wait = 0
        self._probe_trigger = trigger
        self._probing = True
        self._probe_running = num_running
        self._probe_bucket = StepTimeCalibration.load_bucket(num_running)
        return True

    @property
    def on_probation(self) -> bool:
        """Drafting since a probe resumed it for fewer than ``2 x patience`` steps: a lucky probe's resume
        would pause again within that window, so its steps are charged to the probe tax."""
        return (not self._paused and self._wait_at_resume is not None
                and self._drafting_since_resume < 2 * self.patience)

    def record_step_ms(self, drafting: bool, measured_ms: float, kind: str | None = None,
                       num_running: int | None = None, trigger: str | None = None,
                       probe_bucket: int | None = None) -> None:
        """Report the wall time of a step (the probe tax): of kind ``kind`` (:attr:`step_kind` when it began),
        None for the step begun by the last :meth:`begin_step`, of ``num_running`` requests (the account it
        saves into or spends from; None: the load of the step begun last), and begun while :attr:`probe_trigger`
        was ``trigger`` (None: as it is now). An engine that learns a step's time steps later passes all three
        as the step began: by then a load-fall probe may have followed a failed timer probe (whose last step went
        uncharged), or a timer probe a load-fall one (charged to the timer's tax), and the resume a probation
        step belonged to may have been confirmed already (its last step, reported after the forgiveness, was a
        debt left at a load that had just shown drafting pays; on vLLM, two decisions late, it held that load's
        next timer probe back 50 paused steps in a replay). ``probe_bucket``: :attr:`probe_bucket` as the step
        began (None: as it is now), where a probation step is charged, and a probe step given it: reported late, after a load-fall probe
        moved it, a probation step was charged to the new probe's load, one that paused steps there cannot repay.

        A paused step saves ``probe_tax`` of its time; a probe step, or a drafting step on probation, spends
        all of its time. ``drafting`` is whether the step drafted: a plain step the engine took while drafting
        is enabled (to measure plain decoding) neither saves nor spends. An engine that learns a step's time
        only after later steps began (vLLM on CUDA) passes the kind it had: charged to the kind of the step
        begun last -- the paused step after a one-step probe -- the probes of an H200 sitting
        (docs/PERFORMANCE.md section 32) saved into the tax instead of spending it: its varlen server held no
        due probe back in its first 2,800 steps (the sitting before's, 1,104).
        """
        if not (measured_ms > 0 and math.isfinite(measured_ms)):
            return
        kind = self._step_kind if kind is None else kind
        trigger = self._probe_trigger if trigger is None else trigger
        if kind == "probation" and self._probation_held:
            return  # the resume held: what its probation cost was no probing tax
        if kind == "probation":
            # Part of what the probe that resumed drafting cost: charged where it probed, whatever the load now
            # (a bucket no probe ran at has no allowance to fund it, nor one that paused steps would repay).
            bucket = self._probe_bucket if probe_bucket is None else probe_bucket
        elif kind == "probe" and probe_bucket is not None:
            # The same for the probe's own steps, as StepTimer reports them (with the step's charge): a probe of
            # several steps below 16 requests may cross a bucket's edge (3 -> 4 requests), and its later steps
            # went to a bucket that had never probed, whose allowance starts full -- the load that rations the
            # next timer probe paid for one step of four.
            bucket = probe_bucket
        else:
            bucket = StepTimeCalibration.load_bucket(self._last_running if num_running is None else num_running)
        if kind == "probation" and self._accounts.get(bucket, ProbeAllowance()).probe_step_ms is None:
            return  # no probe was timed there: a debt its paused steps could not repay (they save nothing yet)
        account = self._accounts.setdefault(bucket, ProbeAllowance())
        if not drafting:
            if kind == "paused" and account.probe_step_ms is not None:
                # A bucket that has not probed yet saves nothing: its first probe finds the account full anyway.
                account.allowance_ms = min(account.allowance_ms + self.probe_tax * measured_ms,
                                           PROBE_BANK * account.probe_step_ms)
            return
        if kind == "probe":
            if account.probe_step_ms is None:
                # The allowance starts full: the first probes at a load (a fresh server learning where drafting
                # pays, online STS calibrating on what probes verify) do not wait for paused time to fund them.
                account.allowance_ms = max(account.allowance_ms, PROBE_BANK * measured_ms)
                account.probe_step_ms = measured_ms
            else:
                account.probe_step_ms = 0.75 * account.probe_step_ms + 0.25 * measured_ms
        # Only timer probes, and the probation of a resume one made, are rationed, so only they spend: load-fall
        # and rise probes are bounded by the floor and top they move, and their debt (a rise probe at 256
        # requests, 240 ms a step) kept every timer probe of a 16-request cell waiting (section 35).
        if kind in ("probe", "probation") and trigger == "timer":
            account.allowance_ms -= measured_ms

    @property
    def probe_allowance_ms(self) -> float:
        """What the probe tax has left to spend at the load of the step begun last (ms; negative: a timer probe due
        there waits until paused steps repay it)."""
        return self.probe_allowance_at(self._last_running)

    def probe_allowance_at(self, num_running: int) -> float:
        """What the probe tax has left to spend at ``num_running`` requests (ms; 0 where nothing was saved or
        spent at that load yet)."""
        account = self._accounts.get(StepTimeCalibration.load_bucket(num_running))
        return 0.0 if account is None else account.allowance_ms

    @property
    def realized_gain(self) -> float | None:
        """Windowed realized Θ over plain decoding's (> 1: drafting has been paying); None before any outcome."""
        return self._realized.value

    def observe_outcome(
        self, decision: BudgetDecision, emitted_tokens: float, num_running: int, cost_scale: float = 1.0
    ) -> bool:
        """Judge a drafting step by what it produced, then :meth:`observe` the verdict; returns it.

        Confidences can be confidently wrong (a head predicting 3-4x the accepted drafts is common, and STS
        cannot pull a confidence across 0.5), and then every prediction says drafting pays while plain
        decoding would be faster. The outcome cannot be fooled: ``emitted_tokens`` (accepted drafts plus one
        per sampling request) over the step's priced cost is the Θ the step really achieved, on the same
        cost model the decision used. A step pays when the prediction says so *and* the realized Θ beats
        plain decoding -- averaged over a request-weighted window (``REALIZED_MEMORY`` request-steps) to
        ride out acceptance noise, except for a probe, which is judged on its own outcome over at least
        ``PROBE_REQUEST_STEPS`` request-steps (the history is what paused drafting; a probe that resumes
        drafting restarts the window from its own outcome). ``cost_scale`` is what
        a drafting step really costs relative to plain decoding over what the curve says
        (:class:`StepTimeCalibration`); 1 trusts the curve. A decision whose ``stands_for`` is above 1 (a sampled
        probe) counts its accepted drafts that many times.
        """
        if getattr(decision, "scout", False):
            self.counters.scout_steps += 1
            return False  # a scout verified nothing by design: the probe is judged from the step planned after it
        if not all(0 < x < math.inf for x in (decision.step_ms, decision.theta_no_draft, cost_scale)):
            return False  # NaN fails too: one NaN in the window would judge every later step by it
        r = max(1, num_running)
        stands_for = getattr(decision, "stands_for", 1.0)
        if stands_for != 1.0:
            # A sampled probe (CapacityManager.probe_sample_size): its accepted drafts count for the whole batch, as
            # its decision's price does; every running request emitted its own token.
            emitted_tokens = r + stands_for * (emitted_tokens - r)
        step_ms = decision.step_ms * cost_scale
        ratio = (emitted_tokens / step_ms) / decision.theta_no_draft
        self._realized.add(ratio, r)
        if self._probing:
            # At low load a probe drafts for several steps before its verdict (begin_step keeps it going).
            self._probe_tokens += emitted_tokens
            self._probe_ms += step_ms
            self._probe_plain += r / decision.theta_no_draft
            self._probe_requests += r
            self._probe_steps += 1
            if self._probe_requests < PROBE_REQUEST_STEPS and self._probe_steps < PROBE_MAX_STEPS:
                return decision.pays
            probe_ratio = (self._probe_tokens / self._probe_ms) / (self._probe_requests / self._probe_plain)
            probe_requests = self._probe_requests
            running = self._probe_running or r
            self._clear_probe()
            realized = probe_ratio / PROBE_MARGIN
            drafted = None if stands_for == 1.0 else round(r / stands_for)
            self.counters.last_probe = ProbeVerdict(self._probe_trigger, running, realized, decision.pays,
                                                    cost_scale, drafted)
            paid = decision.pays and realized >= 1.0
            self.observe(paid, num_running=num_running, realized=realized)
            if paid:
                # The window still holds the steps that paused drafting (at another load, or before acceptance
                # changed): judged by them, a resume that pays lost again within ``patience`` steps, backed off,
                # and its probation drove the probe tax into debt for thousands of steps. The resumed drafting
                # starts from what the probe showed.
                self._realized = RequestWeightedMean(REALIZED_MEMORY)
                self._realized.add(probe_ratio, probe_requests)
                self._sustained = RequestWeightedMean(SUSTAIN_MEMORY)
                self._sustained.add(probe_ratio, probe_requests)
                self._sustained_requests = probe_requests
            return paid
        self._sustained.add(ratio, r)
        self._sustained_requests += r
        realized = self._realized.value
        paid = decision.pays and realized >= 1.0
        if paid and not self.sustains:
            self.counters.unsustained_steps += 1
            paid = False
        self.observe(paid, num_running=num_running)
        return paid

    @property
    def sustained_gain(self) -> float | None:
        """Realized Θ over plain decoding's across ``SUSTAIN_MEMORY`` request-steps of drafting since it last
        (re)started; None before any outcome."""
        return self._sustained.value

    @property
    def sustains(self) -> bool:
        """Whether drafting clears plain decoding by ``sustain_margin`` over the sustained window (class docstring,
        "Break-even drafting"); True until the window has seen ``SUSTAIN_MEMORY`` request-steps, and always with a
        margin of 0."""
        value = self._sustained.value
        if self.sustain_margin <= 0 or value is None or self._sustained_requests < SUSTAIN_MEMORY:
            return True
        return value >= 1.0 + self.sustain_margin

    @property
    def probe_wait(self) -> int:
        """Paused steps before the next probe (``resume_every``, grown by every failed timer probe -- two to four
        times, by how far short it fell -- and doubled by every resume that pauses again within ``2 x patience``
        steps; failed load probes leave it)."""
        return self._probe_wait

    def observe(self, pays: bool | BudgetDecision, num_running: int = 0, realized: float | None = None) -> None:
        """Report whether a drafting step paid (a bool, or a :class:`BudgetDecision`'s ``pays``); ``num_running`` is
        remembered if this pauses drafting. ``realized``: a judged probe's Θ over plain decoding's, after the margin
        (:meth:`observe_outcome`), by which a failed timer probe backs the timer off (``PROBE_BACKOFF_MAX_GROWTH``);
        None doubles the wait."""
        # BudgetDecision is imported for types only (capacity.py imports this module), so read its fields by name
        if getattr(pays, "scout", False):
            self.counters.scout_steps += 1
            return  # a scout is no verdict (observe_outcome)
        paid = bool(pays.pays) if hasattr(pays, "pays") else bool(pays)
        if self._paused:
            if self._probing:
                trigger = self._probe_trigger
                self.counters.probes[trigger, "paid" if paid else "failed"] += 1
                if paid:
                    # Paid below the load that paused drafting (every load-fall probe, a timer probe in a drain):
                    # that load is still known to lose, so it becomes the ceiling; paid above it but below a
                    # heavier load found losing in this pause (a failed rise probe's), that one does.
                    wait, floor, top = self._probe_wait, self._floor, self._top
                    earned = (self._timer_failed_load, dict(self._failed_waits))
                    ceiling = next((load for load in (self._paused_at, top) if self._probe_running < load), None)
                    self._resume()
                    if ceiling is not None:
                        self._ceiling, self._ceiling_wait = ceiling, wait
                        self._ceiling_floor, self._ceiling_top, self._ceiling_earned = floor, top, earned
                    return
                self._floor = min(self._floor, self._probe_running)
                self._top = max(self._top, self._probe_running)
                if trigger == "timer":
                    self._paused_steps = 0
                    self._probe_wait = min(round(_backoff_growth(realized) * self._probe_wait),
                                           self.MAX_PROBE_BACKOFF * self.resume_every)
                    self._backed_off_at(self._probe_running)
            self._probing = False
            return
        self._drafting_since_resume += 1
        if self._wait_at_resume is not None and self._drafting_since_resume == 2 * self.patience + 1:
            # Past probation: the resume held, and what its probe and probation spent was no probing tax after all.
            account = self._accounts.get(self._probe_bucket)
            if account is not None:
                account.allowance_ms = max(account.allowance_ms, 0.0)
            self._probation_held = True
        if paid:
            self._streak = 0
            return
        self._streak += 1
        if self.patience > 0 and self._streak >= self.patience:
            wait = self.resume_every
            if self._wait_at_resume is not None and self._drafting_since_resume <= 2 * self.patience:
                wait = min(2 * self._wait_at_resume, self.MAX_PROBE_BACKOFF * self.resume_every)
            self._pause(num_running, wait)

    def _clear_probe(self) -> None:
        self._probe_tokens = self._probe_ms = self._probe_plain = 0.0
        self._probe_requests = self._probe_steps = 0

    def _end_probe(self) -> None:
        self._probing = False
        self._clear_probe()

    def _pause(self, num_running: int, probe_wait: int, known_load: int | None = None) -> None:
        """Pause at ``num_running`` requests; ``known_load`` (default: that load) is where drafting was found not to
        pay, which a ceiling's re-pause knows from the pause before."""
        known = num_running if known_load is None else known_load
        self.counters.pauses += 1
        self._paused = True
        self._floor = self._paused_at = self._top = known
        self._paused_steps = 0
        self._probe_wait = probe_wait
        self._timer_failed_load = self._held_steps = 0
        self._failed_waits.clear()
        if probe_wait > self.resume_every:
            # A backoff carried into this pause (a resume that lost on probation, a ceiling the load came back to)
            # was earned at the load found losing, as a failed timer probe's is: a lighter load that holds may
            # reset it.
            self._backed_off_at(known)
        self._streak = 0
        self._ceiling = None

    def _resume(self) -> None:
        self.counters.resumes += 1
        self._wait_at_resume = self._probe_wait
        self._probation_held = False
        self._timer_failed_load = self._held_steps = 0
        self._failed_waits.clear()
        self._drafting_since_resume = 0
        self._paused = False
        self._probing = False
        self._streak = 0
        self._paused_steps = 0
        self._probe_wait = self.resume_every
        self._ceiling = None
