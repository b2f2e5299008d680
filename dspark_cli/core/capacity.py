"""Capacity manager: how many draft slots to verify this step (host, stale) and which ones (device, fresh).

The split follows the paper's production scheduler (§5.2) and vLLM's adaptive verification:

* **Budget (host, stale).** ``choose_budget`` takes a *global* argmax of expected accepted tokens per ms,
  ``Θ(n) = (num_sampling + sum of the n best survivals) / step_cost_ms(R, nondraft + n)``, over every
  ``n``. The survivals come from confidences one or two steps old that are already on the host, so
  planning never waits on the device. A global argmax (not the paper's early stop) is needed because the
  profiled cost is a staircase and Θ is not unimodal; it stays lossless because the *count* depends only
  on information from earlier steps (the "causal barrier"), never on this step's sampled drafts.
* **Allocation (device, fresh).** ``allocate`` spends that count on the globally best ``(request,
  position)`` slots by *current* prefix survival. Survival is non-increasing along a request's drafts,
  so the winners form a prefix per request. Ties break by (position, request), independent of values,
  so tensor-parallel ranks with bitwise-different confidences still agree wherever values tie. Shapes
  are fixed (full sort + rank < budget), so one CUDA graph replays any budget without a host sync.

**Mask mode prices what the uniform batch costs.** ``mask`` keeps the ``[R, K + 1]`` batch and turns a
pruned slot into a padding row: a dense model computes that row anyway, so pruning saves nothing and loses
the draft's chance of acceptance -- the seed's "mask loses everywhere". Unless the engine skips padding
rows (``mask_pruning_saves``: vLLM's MoE layers with ``VLLM_MOE_SKIP_PADDING``), the budget is priced at
the full batch's cost and set to every draft under the cap (``budget_frac``; the explicit threshold policy
still prunes as told, unless ``min_predicted_gain`` asks for a predicted gain, which a flat cost never shows),
so mask pays only through the saturation policy.

``schedule_paper`` is the paper's Algorithm 1 (greedy with early stop on fresh values), kept for the
simulator and as an option; the saturation policy (:mod:`dspark_cli.core.saturation`) stops paying for
the draft pass when verification stops paying; ``CapacityManager`` ties the pieces together for an engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np
import torch

from dspark_cli.core.checks import check_float, check_int, check_probe_tax
from dspark_cli.core.saturation import (
    PROBE_TAX,
    SUSTAIN_MARGIN,
    SaturationPolicy,
    StepCharge,
    StepTimeCalibration,
    StepTimer,
)
from dspark_cli.core.sps import SpsCurve
from dspark_cli.errors import DsparkError

# Trim only where the curve predicts at least this gain over verifying every draft (Θ(best) >= Θ(full) x (1 +
# gain)); below it the full draft is kept. A predicted gain of a percent or two is inside what the curve does not
# price: on an H100 (issue 8's scaled setup, k=7, 16 requests; docs/PERFORMANCE.md section 36) argmax trimmed
# to 3 drafts a request for a predicted +0.9%, and two runs realized -0.2% and -5.3% against verifying
# everything (acceptance fell 3% as predicted; the step's saving came out at -0.65 and +0.58 ms against a
# priced -0.77). At 32 requests a predicted +6.0% realized +3.7% and +3.2%. 0 trims on any predicted gain. The
# threshold policy prunes as its threshold says unless a gain is asked for: its user chose the slots to keep.
MIN_PREDICTED_GAIN = 0.03

# CapacityConfig.probe_sample's default (CapacityManager.probe_sample_size says why probes are sampled). On an H100
# (Llama-3-8B shape, 256 requests; docs/PERFORMANCE.md section 42) a probe drafting for 32 or for 64 requests cost
# the same, ~2.4x a paused step against ~12x for all 256; 64 halves the noise of a verdict near break-even, which
# 32 requests of 64 let through once (a probe at 1.04x, then 250 drafting steps at a loss).
PROBE_SAMPLE = 64

# A probe whose policy may scout (``probe_scout``; core.saturation, "Scouts") scouts where the plan it would run
# instead -- every draft verified, on confidences it cannot know -- is priced above this many steps that verify
# nothing: the scout, and where drafting still loses the judged step after it, which then verifies ~nothing. At a
# light load verification is nearly free and one probe step is cheaper than two; at 256 requests of an 8B-shaped
# target the probe's plan cost ~6.7x a paused step (docs/PERFORMANCE.md section 40).
SCOUT_PRICE = 2.0

Mode = Literal["none", "mask", "varlen"]
Policy = Literal["argmax", "paper", "threshold"]
MODES: tuple[str, ...] = ("none", "mask", "varlen")
POLICIES: tuple[str, ...] = ("argmax", "paper", "threshold")


# ---------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class CapacityConfig:
    """Capacity-manager settings (validated on construction; bad values raise :class:`DsparkError`).

    ``mode``: ``none`` verifies every draft (no capacity manager), ``mask`` keeps the uniform batch and
    marks pruned slots as padding, ``varlen`` compacts the verify batch. ``policy`` picks the budget rule.
    ``mask_pruning_saves``: in mask mode, whether a padding row costs less than a verified one (the engine
    skips it); False prices the uniform batch at its full size (module docstring).
    """

    mode: Mode = "none"
    policy: Policy = "argmax"
    budget_frac: float = 1.0  # hard cap: budget <= floor(budget_frac * total drafts)
    threshold: float = 0.0  # policy="threshold": admit slots with survival >= threshold
    min_predicted_gain: float | None = None  # trim only if Θ(best) >= Θ(full) * (1 + gain); None: trim_margin
    saturation_patience: int = 8  # consecutive non-paying steps before drafting pauses (0 = never)
    resume_every: int = 16  # while paused, one probe step with drafting every N steps
    probe_tax: float = PROBE_TAX  # timed engines: probes may spend this share of paused time (SaturationPolicy)
    mask_pruning_saves: bool = False  # mask mode: padding rows are skipped (MoE with skip-padding), not computed
    probe_scout: bool = False  # varlen: a probe's first step verifies nothing (SaturationPolicy, "Scouts")
    # drafting must clear plain decoding by this over a longer window to go on (SaturationPolicy, "Break-even
    # drafting"); 0 judges by the short window alone
    sustain_margin: float = SUSTAIN_MARGIN
    # Engines whose probe catches the draft up over the pause (the embedded engine): a probe drafts for at most this
    # many requests, those the draft is least behind, and is judged as the full batch (``choose_budget``'s
    # ``stands_for``); 0 drafts for every request. Why, and why 64: ``PROBE_SAMPLE``.
    probe_sample: int = PROBE_SAMPLE

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise DsparkError(f"capacity mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.policy not in POLICIES:
            raise DsparkError(f"capacity policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        check_float("budget_frac", self.budget_frac, 0.0, 1.0)
        check_float("threshold", self.threshold, 0.0, 1.0)
        if self.min_predicted_gain is not None:
            check_float("min_predicted_gain", self.min_predicted_gain, 0.0, math.inf)
        check_int("saturation_patience", self.saturation_patience, 0)
        check_int("resume_every", self.resume_every, 1)
        check_probe_tax(self.probe_tax)
        check_float("sustain_margin", self.sustain_margin, 0.0, 1.0)
        if not isinstance(self.mask_pruning_saves, bool):
            raise DsparkError(f"capacity setting mask_pruning_saves must be true or false, got {self.mask_pruning_saves!r}")
        if not isinstance(self.probe_scout, bool):
            raise DsparkError(f"capacity setting probe_scout must be true or false, got {self.probe_scout!r}")
        check_int("probe_sample", self.probe_sample, 0)
        if self.probe_scout and self.mode == "mask":
            # mask's uniform batch computes every draft row whatever is verified: a scout would cost a whole probe
            # step and judge nothing (with no capacity manager the saturation policy never runs: no probe to scout)
            raise DsparkError("capacity setting probe_scout needs capacity mode varlen: mask mode computes every "
                              "draft row whatever is verified, so a scout would cost a whole probe step; drop it")

    @property
    def trim_margin(self) -> float:
        """The predicted gain a trim must clear: ``min_predicted_gain`` as given, else ``MIN_PREDICTED_GAIN`` -- or 0
        under the threshold policy, which prunes as its threshold says."""
        if self.min_predicted_gain is not None:
            return self.min_predicted_gain
        return 0.0 if self.policy == "threshold" else MIN_PREDICTED_GAIN

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> CapacityConfig:
        """Build from a mapping of field names; unknown keys are refused (typos must not pass silently)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise DsparkError(f"unknown capacity setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**obj)


# ---------------------------------------------------------------------------------------------- survival


def prefix_survival(conf: torch.Tensor) -> torch.Tensor:
    """a[r, j] = prod_{i<=j} c[r, i]: the probability that draft j and all before it are accepted.

    Confidences are clamped to [0, 1] first so a slightly out-of-range head output cannot make survival
    rise along a request (which would break the prefix shape of the allocation), and a NaN (a head that
    overflowed) counts as 0: that draft and the ones after it are not worth verifying, and one NaN must not
    make the whole batch's budget NaN.
    """
    return torch.cumprod(torch.nan_to_num(conf.float(), nan=0.0).clamp(0.0, 1.0), dim=-1)


def _unit_clamp(x: np.ndarray) -> np.ndarray:
    """``x`` clamped to [0, 1] with NaN read as 0 (fmax takes the number over a NaN): what ``nan_to_num`` then
    ``clip`` give, in two ufuncs instead of a Python-level function run on every drafting step."""
    return np.fmin(np.fmax(x, 0.0), 1.0)


def _np_survival(conf: np.ndarray) -> np.ndarray:
    return np.cumprod(_unit_clamp(np.asarray(conf, dtype=np.float64)), axis=-1)


def _valid_mask(shape: tuple[int, int], num_drafts: np.ndarray | None) -> np.ndarray:
    r, k = shape
    if num_drafts is None:
        return np.ones((r, k), dtype=bool)
    nd = np.clip(np.asarray(num_drafts, dtype=np.int64).reshape(r), 0, k)
    return np.arange(k)[None, :] < nd[:, None]


# ---------------------------------------------------------------------------------------------- Algorithm 1


def schedule_paper(
    confidences: torch.Tensor | np.ndarray,
    sps: SpsCurve,
    num_drafts: np.ndarray | torch.Tensor | None = None,
    num_nondraft_tokens: int | None = None,
    num_sampling: int | None = None,
) -> np.ndarray:
    """The paper's Algorithm 1: greedy admission by prefix survival with early stop.

    Slots ``(r, j)`` with survival > 0 are walked in descending survival (ties by position, then
    request); each admission adds one batch token and its survival to τ. The walk stops at the first
    admission that does not strictly improve Θ = τ / step_cost_ms(R, B), so ties favour shorter
    verification. Stopping early is what makes it lossless on fresh confidences: the decision to admit
    token k never looks at c_{k+1}, which depends on the sampled x_k (paper App. A).

    ``B`` starts at R (every request verifies its anchor/bonus slot) unless ``num_nondraft_tokens`` says
    otherwise; τ starts at ``num_sampling`` (default R). Returns verify lengths ``ℓ[R]`` (int64).
    """
    # Widened, never narrowed: rounding float64 confidences through float32 turned exact ties of Θ (which
    # must stop the walk) into strict gains.
    if isinstance(confidences, torch.Tensor):
        confidences = confidences.detach().to(torch.float64).cpu().numpy()
    conf = np.asarray(confidences, dtype=np.float64)
    if conf.ndim != 2:
        raise ValueError(f"confidences must be [R, K], got shape {conf.shape}")
    r, k = conf.shape
    if isinstance(num_drafts, torch.Tensor):
        num_drafts = num_drafts.cpu().numpy()
    surv = _np_survival(conf)
    valid = _valid_mask((r, k), num_drafts) & (surv > 0)
    lengths = np.zeros(r, dtype=np.int64)
    if r == 0:
        return lengths
    # Position-major flat index j*R + r; a stable descending sort breaks value ties by (position, request).
    flat = surv.T.reshape(-1)
    flat_valid = valid.T.reshape(-1)
    cand = np.flatnonzero(flat_valid)
    order = cand[np.argsort(-flat[cand], kind="stable")]
    b = r if num_nondraft_tokens is None else int(num_nondraft_tokens)
    tau = float(r if num_sampling is None else num_sampling)
    best = tau / sps.step_cost_ms(r, b)
    current = np.zeros(r, dtype=np.int64)
    for idx in order:
        j, req = divmod(int(idx), r)
        current[req] = j + 1
        b += 1
        tau += float(flat[idx])
        theta = tau / sps.step_cost_ms(r, b)
        if theta > best:
            best = theta
            lengths[:] = current
        else:
            break
    return lengths


# ---------------------------------------------------------------------------------------------- budget


@dataclass(frozen=True)
class BudgetDecision:
    """One step's budget and the predictions behind it (engines and the simulator log these).

    Θ values are expected accepted tokens (bonus included) per millisecond.
    """

    budget: int  # draft slots to verify this step
    theta_best: float  # Θ at the chosen budget
    theta_all: float  # Θ verifying every draft
    theta_no_draft: float  # Θ without the draft pass at all (plain decoding)
    step_ms: float  # predicted step cost at the chosen budget
    total_drafts: int  # drafts available this step
    plain_ms: float = 0.0  # predicted cost of the same step decoded plainly (0: not priced)
    scout: bool = False  # a probe's scout step: verifies nothing, is not judged (SaturationPolicy)
    # A sampled probe's (choose_budget's ``stands_for``): each drafting request stands for this many of the batch,
    # and the Θ values and price above are the whole batch's, drafting as the sample did.
    stands_for: float = 1.0

    @property
    def pays(self) -> bool:
        """Whether drafting is worth its cost this step (budget > 0 and beats plain decoding)."""
        return self.budget > 0 and self.theta_best > self.theta_no_draft

    @property
    def verifies_every_draft(self) -> bool:
        """The budget covers every draft of the step: the allocation has nothing to choose, and an engine may
        admit every draft as capacity ``none`` does instead of launching it (``allocate`` would also leave out a
        draft whose fresh survival is 0 or NaN; verifying one anyway is as lossless as verifying any draft)."""
        return self.budget >= self.total_drafts


def choose_budget(
    stale_survival: np.ndarray,
    num_drafts: np.ndarray,
    num_nondraft_tokens: int,
    num_sampling: int,
    sps: SpsCurve,
    cfg: CapacityConfig,
    sampling: bool = False,
    max_budget: int | None = None,
    batch_drafts: int | None = None,
    scout: bool = False,
    stands_for: float = 1.0,
) -> BudgetDecision:
    """Pick this step's verify budget on the host from stale survival; see the module docstring.

    ``stale_survival[R, K]`` is prefix survival from earlier steps (rows of new requests are all ones),
    ``num_drafts[R]`` the drafts each request carries this step, ``num_nondraft_tokens`` every batch
    token that is not a draft (bonus/anchor tokens and prefill chunks), ``num_sampling`` the requests that
    will emit a token this step, ``sampling`` whether some request samples (the draft pass is then the
    sampling one, priced by the curve's sampling draft cost). Θ(n) is evaluated for every n in one
    vectorised cost lookup; the first maximum wins, so ties pick the smaller budget.

    ``max_budget``: a limit of the engine's (vLLM verifies at most one chunk of logit rows). The choice is made
    within it, so the decision's Θ and price are those of a budget that can run, not a larger one clamped after.
    ``batch_drafts``: the draft rows the batch computes whatever is verified, where it holds drafts that
    ``num_drafts`` does not admit (vLLM's placeholder drafts of a slot the draft skipped): mask mode's uniform
    batch is priced with them (default: the admitted drafts).
    ``scout``: the step begins a probe that may scout (``SaturationPolicy.scouting``). In varlen, where the chosen
    budget is priced above ``SCOUT_PRICE`` times verifying nothing, the step verifies nothing and its decision says
    ``scout`` (not judged); else it is chosen as any other.
    ``stands_for``: only a sample of the batch drafts (a sampled probe, ``CapacityManager.probe_sample_size``), the
    rows of ``num_drafts`` that carry drafts, and each stands for this many requests. The budget is chosen for the
    sample, priced and valued as the whole batch drafting alike: ``n`` of the sample's slots stand for
    ``stands_for x n`` verified slots and their survival for ``stands_for`` times as many accepted tokens, and the
    draft pass is priced for all ``R`` requests. The question a probe answers is whether drafting pays at this
    load, not whether drafting for the sample does.
    """
    surv = np.asarray(stale_survival, dtype=np.float64)
    if surv.ndim != 2:
        raise ValueError(f"stale_survival must be [R, K], got shape {surv.shape}")
    r, k = surv.shape
    valid = _valid_mask((r, k), num_drafts)
    total = int(valid.sum())
    # NaN survival (a head that overflowed) counts as 0, as in the allocation: sorted, a NaN would lead the
    # order and make every Θ(n) NaN, so one NaN slot cut the whole batch's budget to 1
    vals = np.sort(_unit_clamp(surv[valid]))[::-1]
    if not (math.isfinite(stands_for) and stands_for >= 1.0):
        raise ValueError(f"stands_for must be a finite number >= 1, got {stands_for!r}")
    tau = float(num_sampling) + stands_for * np.concatenate(([0.0], np.cumsum(vals)))
    if cfg.mode == "mask" and not cfg.mask_pruning_saves:
        # every draft row is in the batch, verified or padding (a sample's batch, the whole batch's drafts)
        every = stands_for * total
        verified = np.full(total + 1, every if batch_drafts is None else max(every, int(batch_drafts)))
        cost = np.asarray(sps.step_cost_ms(r, num_nondraft_tokens + verified, sampling=sampling), dtype=np.float64)
    else:
        cost = sps.budget_costs_ms(r, num_nondraft_tokens, total, stands_for, sampling)
    theta = tau / cost
    no_draft_cost = float(sps.step_cost_ms(r, num_nondraft_tokens, drafting=False))
    theta_no_draft = float(num_sampling) / no_draft_cost

    limit = total if max_budget is None else max(0, min(total, int(max_budget)))
    if cfg.mode == "none":
        budget = limit
    else:
        cap = min(limit, int(math.floor(cfg.budget_frac * total + 1e-9)))
        if cfg.policy == "threshold":
            budget = min(cap, int((vals >= cfg.threshold).sum()))
        elif cfg.mode == "mask" and not cfg.mask_pruning_saves:
            # Every budget costs the uniform batch: Θ is flat wherever survival adds ~nothing, and a first
            # maximum (or the paper's early stop) there would prune rows that are computed anyway.
            budget = cap
        elif cfg.policy == "paper":
            # Early stop along the sorted stale survivals: the first n whose Θ does not beat Θ(n-1) ends it.
            worse = np.flatnonzero(theta[1 : cap + 1] <= theta[:cap])
            budget = int(worse[0]) if len(worse) else cap
        else:
            budget = int(np.argmax(theta[: cap + 1]))
        margin = cfg.trim_margin
        if (margin > 0 and budget < cap and theta[budget] < theta[cap] * (1 + margin)
                and not theta[cap] <= theta_no_draft < theta[budget]):
            # The predicted win is within the model's error: keep the full draft -- unless the trim pays where the
            # full draft would not (kept, the step would count as losing and push the saturation policy to pause).
            budget = cap
    is_scout = scout and cfg.mode == "varlen" and budget > 0 and cost[budget] > SCOUT_PRICE * cost[0]
    if is_scout:
        budget = 0
    return BudgetDecision(
        budget=budget,
        theta_best=float(theta[budget]),
        theta_all=float(theta[total]),
        theta_no_draft=theta_no_draft,
        step_ms=float(cost[budget]),
        total_drafts=total,
        plain_ms=no_draft_cost,
        scout=is_scout,
        stands_for=float(stands_for),
    )


# ---------------------------------------------------------------------------------------------- allocation


def allocate(
    survival: torch.Tensor, num_drafts: torch.Tensor, budget: torch.Tensor | int, use_triton: bool | None = None
) -> torch.Tensor:
    """Admit the top-``budget`` slots by fresh survival; returns admitted drafts per request ``[R]`` int32.

    Valid slots are ``j < num_drafts[r]`` with survival > 0. The flat order is position-major (index
    ``j*R + r``) and the sort is stable and descending, so equal values rank by (position, request)
    whatever the values are. Survival is made non-increasing along each row (``cummin``) so the admitted
    set is a prefix per request even for hand-made inputs, and the per-row count is the verify length.
    Fixed shapes and no host reads: capturable in a CUDA graph, ``budget`` may be a 0-d device tensor.

    ``use_triton``: None = the single-launch kernel (``_triton_capacity``) on CUDA when triton is installed
    and the batch fits one program, else the torch sort below (the reference); False = torch only.
    """
    if _use_triton_allocate(survival, budget, use_triton):
        from dspark_cli.core import _triton_capacity

        return _triton_capacity.allocate_fused(survival, num_drafts, budget)
    return _allocate_torch(survival, num_drafts, budget)


def warm_up_allocate(
    num_spec: int, max_reqs: int, device: torch.device | str, drafts_dtype: torch.dtype = torch.int64
) -> int:
    """Compile the allocation kernel for every request-count bucket up to ``max_reqs`` now.

    Engines call this at start-up so that no step pays a kernel compile the first time its batch size
    lands in a new power-of-two bucket. ``drafts_dtype`` must be the dtype of the ``num_drafts`` the engine
    passes: the kernel is compiled per argument dtype (vLLM's scheduled-draft buffer is int32, and warming
    up with int64 left one compile per bucket inside serving on the H200). Returns how many buckets ran
    (0 where the torch path is used).
    """
    device = torch.device(device)
    ran = 0
    size = 1
    while True:
        r = min(size, max_reqs)
        survival = torch.ones(r, num_spec, device=device)
        if not _use_triton_allocate(survival, r, None):
            return ran
        allocate(survival, torch.full((r,), num_spec, dtype=drafts_dtype, device=device), r)
        ran += 1
        if size >= max_reqs:
            return ran
        size *= 2


def _use_triton_allocate(survival: torch.Tensor, budget: torch.Tensor | int, use_triton: bool | None) -> bool:
    if use_triton is False or survival.dim() != 2:
        return False
    from dspark_cli.core import _triton_capacity, _triton_rejection

    # A fractional budget tensor keeps the torch semantics (rank < budget) rather than being rounded.
    shape_ok = _triton_capacity.fits(*survival.shape) and not (
        isinstance(budget, torch.Tensor) and (budget.is_floating_point() or budget.numel() != 1))
    if use_triton is None:
        return shape_ok and _triton_rejection.available(survival.device)
    if not _triton_rejection.supported(survival.device):
        raise RuntimeError("use_triton=True needs triton and a CUDA device (or TRITON_INTERPRET=1 on CPU)")
    return shape_ok


def _allocate_torch(survival: torch.Tensor, num_drafts: torch.Tensor, budget: torch.Tensor | int) -> torch.Tensor:
    r, k = survival.shape
    device = survival.device
    surv = survival.float()
    surv = torch.where(torch.isnan(surv), torch.zeros_like(surv), surv)
    surv = torch.cummin(surv, dim=1).values
    pos = torch.arange(k, device=device)
    valid = (pos.unsqueeze(0) < num_drafts.to(device).long().unsqueeze(1)) & (surv > 0)
    keyed = torch.where(valid, surv, torch.full_like(surv, -1.0))
    flat = keyed.t().reshape(-1)
    order = torch.sort(flat, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(0, order, torch.arange(r * k, device=device))
    admit = (rank < budget) & valid.t().reshape(-1)
    return admit.view(k, r).sum(dim=0, dtype=torch.int32)


# ---------------------------------------------------------------------------------------------- manager


class CapacityManager:
    """What an engine holds: config, curve, the confidence buffers and the saturation policy.

    Per step, in this order:

    1. ``begin_step(num_running)`` -> draft this step or not (saturation policy);
    2. after the draft pass, ``record_confidences(slots, conf)`` with the (STS-calibrated) confidences;
       this scatters them into the device buffer and starts an async copy to a pinned host buffer;
    3. ``plan(slots_np, num_drafts_np, num_nondraft_tokens, num_sampling)`` chooses the budget on the
       host from the snapshot taken by the *previous* ``record_confidences`` (one step stale, or two if
       ``plan`` runs before this step's record) -- never this step's values, whose Markov dependence on
       the sampled drafts would leak into the count; waiting on that copy's event costs nothing because
       it was issued a whole step earlier;
    4. ``allocate(slots, num_drafts, budget)`` spends the budget on the device with fresh survival;
    5. optionally, once the step's outcome is on the host, ``record_outcome(emitted_tokens)``: with
       ``plan(..., defer_saturation=True)`` the saturation policy then judges the step by what it really
       produced, not only by what the confidences predicted (see :meth:`record_outcome`).

    With ``probe_scout`` the step that begins a probe may plan a budget of 0 (``BudgetDecision.scout``; where the
    curve prices its plan above ``SCOUT_PRICE`` such steps, :func:`choose_budget`), and the probe's next step
    plans on the scout's confidences -- the previous record when ``plan`` follows this step's
    own, as above; an engine that plans before recording would read the snapshot from before the pause.

    Slots are engine-owned rows (0..max_slots-1). ``add_request(slot)`` marks a slot fresh: its device
    row and both host rows become 1 (unknown = "certainly accepted", as vLLM/SGLang do), and a snapshot
    taken before the add is ignored for that slot, so a reused slot never inherits its old occupant.
    """

    def __init__(
        self,
        cfg: CapacityConfig,
        curve: SpsCurve,
        num_spec_tokens: int,
        max_slots: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_spec_tokens < 1 or max_slots < 1:
            raise DsparkError("capacity manager needs num_spec_tokens >= 1 and max_slots >= 1")
        self.cfg = cfg
        self.curve = curve
        self.k = num_spec_tokens
        self.max_slots = max_slots
        self.device = torch.device(device)
        self.saturation = SaturationPolicy.from_config(cfg)
        self.conf = torch.ones(max_slots, num_spec_tokens, dtype=torch.float32, device=self.device)
        pin = self.device.type == "cuda"
        self._host = [
            torch.ones(max_slots, num_spec_tokens, dtype=torch.float32, pin_memory=pin) for _ in range(2)
        ]
        # One event per host buffer, re-recorded with each snapshot: a fresh event per step costs a driver call.
        self._events: list[Any] = [torch.cuda.Event(), torch.cuda.Event()] if pin else [None, None]
        self._host_record_id = [0, 0]  # which record_confidences call each host buffer holds
        self._num_records = 0
        self._write = 0  # host buffer the next record fills
        self._added_at = np.full(max_slots, -1, dtype=np.int64)
        self._adds = 0  # add_request calls: one since a lookahead may have refilled a slot it read (plan_ahead)
        self._lookahead: tuple[tuple[Any, ...], BudgetDecision] | None = None
        self.lookahead_plans = 0  # plan_ahead calls
        self.lookahead_hits = 0  # plans that took a lookahead's decision instead of choosing one
        # Confidences recorded before the last paused step: a probe's plan reads the snapshot before its own,
        # taken before the pause however long ago; the pause may have come from confidences since recovered,
        # and a probe planned on them verified nothing and failed, doubling the wait (unknown rows read 1).
        self._records_at_pause = -1
        self.last_decision: BudgetDecision | None = None
        self._pending_running = 0
        self.timer = StepTimer(self.saturation)

    # -- saturation
    @property
    def probe_step(self) -> bool:
        """The step begun by the last :meth:`begin_step` drafts as a saturation probe (after a pause)."""
        return self.timer.probe_step

    @property
    def step_times(self) -> StepTimeCalibration:
        return self.timer.step_times

    @property
    def drafting_enabled(self) -> bool:
        return self.cfg.mode == "none" or self.saturation.drafting_enabled

    def probe_sample_size(self, num_running: int) -> int:
        """How many of ``num_running`` requests the step begun last drafts for: all, except in a probe step under
        ``probe_sample`` (``CapacityConfig``), where at most that many draft and the step is planned with
        ``stands_for = num_running / sample`` (:func:`choose_budget`).

        Why: a paused draft feeds nothing (the embedded engine's paused step is plain decoding), so a probe's draft
        pass first catches every request up over the whole pause -- its prompt too, for a request admitted during
        it. That work grows with the pause, so probing less often does not make it cheaper: on an H100 (Llama-3-8B
        shape, 256 requests; docs/PERFORMANCE.md section 41) a probe cost ~12x a paused step, mostly that catch-up,
        and probes took 3.4% of the cell where drafting never paid. Whether drafting pays at a load is a question
        of the load's step price and of how many drafts survive; a sample answers the second, the curve the first.
        The engine picks the requests the draft is least behind, so the catch-up is the sample's smallest. The
        other requests catch up only if the probe resumes drafting, on its first step, which a resume pays for
        as it did inside the probe before (and the engine keeps out of the step-time calibration)."""
        n = self.cfg.probe_sample
        if n <= 0 or num_running <= n or not self.probe_step or self.cfg.mode == "none":
            return num_running
        return n

    def begin_step(self, num_running: int) -> bool:
        """Whether this step drafts (:meth:`StepTimer.begin_step`: an engine that times its steps with
        :meth:`record_step_time` also gets a plain step now and then while drafting is on)."""
        if self.cfg.mode == "none":
            return True  # the policy never runs: no step is a probe
        drafting = self.timer.begin_step(num_running)
        if not drafting and not self.saturation.drafting_enabled:
            self._records_at_pause = self._num_records
        return drafting

    def record_step_time(self, drafting: bool, num_reqs: int, measured_ms: float, priced_ms: float | None = None,
                         calibrate: bool = True, charge: StepCharge | None = None) -> None:
        """Report a decode step's measured wall time (host clock, the step's own sync included).

        ``priced_ms``: what the curve charged; defaults to the last decision's ``step_ms`` for a drafting
        step and to the curve's plain-decoding cost of ``num_reqs`` requests for a plain one. Probe steps
        are skipped: their catch-up over the pause is the price of probing, not of drafting. Every step's
        time also goes to the saturation policy's probe tax (:meth:`SaturationPolicy.record_step_ms`).
        ``calibrate=False``: the step did work that is not what drafting costs (the catch-up a sampled probe left
        to the resume, :meth:`probe_sample_size`); it counts for the probe tax only (:meth:`StepTimer.record`).
        ``charge``: :attr:`SaturationPolicy.step_charge` as the step began, for a time reported after a later step
        began (None: the step begun last).
        """
        if self.cfg.mode == "none":
            return
        if priced_ms is None:
            if not drafting:
                priced_ms = self.curve.step_cost_ms(num_reqs, num_reqs, drafting=False)  # a float, cached per count
            elif self.last_decision is not None:
                priced_ms = self.last_decision.step_ms
            else:
                kind, trigger, bucket = charge if charge is not None else (None, None, None)
                self.saturation.record_step_ms(drafting, measured_ms, kind, num_reqs, trigger, bucket)
                return
        self.timer.record(drafting, num_reqs, measured_ms, priced_ms, calibrate=calibrate, charge=charge)

    # -- confidences
    def add_request(self, slot: int) -> None:
        self.conf[slot].fill_(1.0)
        for buf in self._host:
            buf[slot].fill_(1.0)
        self._added_at[slot] = self._num_records
        self._adds += 1

    def record_confidences(self, slots: torch.Tensor, conf: torch.Tensor) -> None:
        """Store this step's confidences ``conf[R, K]`` for ``slots[R]`` (device) and snapshot to the host."""
        self.conf.index_copy_(0, slots.to(self.device).long(), conf.to(self.device, torch.float32))
        w = self._write
        self._num_records += 1
        if self.device.type == "cuda":
            self._host[w].copy_(self.conf, non_blocking=True)
            self._events[w].record()
        else:
            self._host[w].copy_(self.conf)
        self._host_record_id[w] = self._num_records
        self._write = 1 - w

    def stale_confidences(self, slots_np: np.ndarray) -> np.ndarray:
        """Host confidences for ``slots_np`` from the snapshot before the latest one (ones for new slots, and for
        every slot when that snapshot predates a pause)."""
        # the buffer the next record will overwrite holds the older snapshot
        return self._snapshot_rows(self._write, np.asarray(slots_np, dtype=np.int64))

    def _snapshot_rows(self, read: int, slots_np: np.ndarray) -> np.ndarray:
        """``slots_np``'s rows of host buffer ``read`` (waiting for its copy), as a plan reads them."""
        snap_id = self._host_record_id[read]
        event = self._events[read]
        if event is not None and snap_id:
            event.synchronize()  # issued a step ago: already complete in practice
        rows = self._host[read].numpy()[slots_np].copy()
        if snap_id <= self._records_at_pause:
            rows[:] = 1.0
        else:
            rows[self._added_at[slots_np] >= snap_id] = 1.0
        return rows

    # -- planning and allocation
    def plan(
        self,
        slots_np: np.ndarray,
        num_drafts_np: np.ndarray,
        num_nondraft_tokens: int,
        num_sampling: int,
        defer_saturation: bool = False,
        sampling: bool = False,
        stands_for: float = 1.0,
    ) -> BudgetDecision:
        """Choose this step's budget (:func:`choose_budget`, on the stale confidences of ``slots_np``).
        ``stands_for``: a sampled probe's (:meth:`probe_sample_size`): the rows of ``num_drafts_np`` that carry
        drafts stand for the whole batch, each for this many requests; :meth:`record_outcome` judges the step so."""
        slots_np = np.asarray(slots_np, dtype=np.int64)
        num_drafts_np = np.asarray(num_drafts_np, dtype=np.int64)
        # A scout verifies nothing; the probe's next step plans on the confidences this one records.
        scout = self.saturation.scouting
        ahead, self._lookahead = self._lookahead, None
        if ahead is not None and ahead[0] == self._plan_key(self._write, slots_np, num_drafts_np, num_nondraft_tokens,
                                                            num_sampling, sampling, scout, stands_for):
            decision = ahead[1]
            self.lookahead_hits += 1
        else:
            decision = choose_budget(
                _np_survival(self.stale_confidences(slots_np)), num_drafts_np, num_nondraft_tokens, num_sampling,
                self.curve, self.cfg, sampling, scout=scout, stands_for=stands_for,
            )
        self.last_decision = decision
        self._pending_running = len(slots_np)
        if self.cfg.mode != "none" and not defer_saturation:
            self.saturation.observe(decision, num_running=len(slots_np))
        return decision

    def plan_ahead(self, slots_np: np.ndarray, num_drafts_np: np.ndarray, num_nondraft_tokens: int,
                   num_sampling: int, sampling: bool = False) -> None:
        """Choose the next step's budget now, for a next step with this step's batch: :meth:`plan` takes it instead
        of choosing one where nothing it reads has changed, and chooses as before where anything has.

        Why: a plan is host work between the draft pass and the verify forward, and where the draft pass takes the
        device less time than the plan takes the host (a host-bound step: a small model, a light load) the device
        waits for it. The plan reads only the snapshot before its step's own, which is this step's: an engine calls
        this once that snapshot is recorded and its step's verify is launched, and the host's wait for the device
        hides it. Where the draft pass is long the plan was hidden already: on an H100 (Llama-3-8B shape, synthetic
        drafter with a 2-layer draft, 16 requests; docs/PERFORMANCE.md section 48) the step's own plan went from
        0.36 to 0.13-0.21 ms of host time and its step did not get shorter, the device still running the draft
        pass when the host looked ahead (the lookahead waited 5.5-7 ms for the snapshot).

        Nothing here changes what a plan decides: the lookahead is keyed on all that the choice reads -- the
        snapshot (its record, whether a pause came since, whether a slot was refilled), the slots and their
        drafts, the batch's tokens, sampling, the probe's scouting -- and is used once. A batch that lost or gained
        a request plans afresh. Scouting is only known when the next step begins: looked ahead without it.
        """
        slots_np = np.asarray(slots_np, dtype=np.int64)
        num_drafts_np = np.asarray(num_drafts_np, dtype=np.int64)
        read = 1 - self._write  # the latest snapshot: the older one once the next step records its own
        key = self._plan_key(read, slots_np, num_drafts_np, num_nondraft_tokens, num_sampling, sampling, False, 1.0)
        decision = choose_budget(
            _np_survival(self._snapshot_rows(read, slots_np)), num_drafts_np, num_nondraft_tokens, num_sampling,
            self.curve, self.cfg, sampling,
        )
        self._lookahead = (key, decision)
        self.lookahead_plans += 1

    def _plan_key(self, read: int, slots_np: np.ndarray, num_drafts_np: np.ndarray, num_nondraft_tokens: int,
                  num_sampling: int, sampling: bool, scout: bool, stands_for: float) -> tuple[Any, ...]:
        """Everything a plan's choice reads, as a plan from host buffer ``read`` would read it."""
        return (self._host_record_id[read], self._records_at_pause, self._adds, slots_np.tobytes(),
                num_drafts_np.tobytes(), int(num_nondraft_tokens), int(num_sampling), bool(sampling), bool(scout),
                float(stands_for))

    def record_outcome(self, emitted_tokens: int) -> bool:
        """Judge the last planned step by what it produced (``SaturationPolicy.observe_outcome``).

        ``emitted_tokens``: accepted drafts plus one per sampling request (every running request). Use with
        ``plan(..., defer_saturation=True)``; returns whether the step paid (a sampled probe's as the whole batch:
        ``SaturationPolicy.observe_outcome``).
        """
        decision = self.last_decision
        if decision is None:
            return False
        if self.cfg.mode == "none":
            return decision.pays
        running = self._pending_running
        return self.saturation.observe_outcome(decision, emitted_tokens, running,
                                               self.timer.cost_scale(running, decision))

    @property
    def realized_gain(self) -> float | None:
        """Windowed realized Θ over plain decoding's (> 1: drafting has been paying); None before any outcome."""
        return self.saturation.realized_gain

    def allocate(self, slots: torch.Tensor, num_drafts: torch.Tensor, budget: torch.Tensor | int) -> torch.Tensor:
        fresh = self.conf.index_select(0, slots.to(self.device).long())
        return allocate(prefix_survival(fresh), num_drafts, budget)
