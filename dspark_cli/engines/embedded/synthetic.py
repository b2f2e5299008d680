"""The synthetic drafter: real draft step costs, acceptance drawn from a controlled latent probability.

A speed study of verification capacity needs a target big enough to saturate the device (e.g.
``random:llama-3-8b``), and random weights make every step cost right but every acceptance meaningless: a
random draft is never accepted by a random target. This mode (``--draft synthetic[:...]``, vLLM's
``rejection_sample_method="synthetic"`` in spirit) keeps the costs and replaces only the outcome:

* the **draft pass is real**: a small draft model (default ``random:small``, a 2-layer model of the
  target's width and vocabulary; any draft name works) runs its catch-up pass and its K - 1 steps, so the
  draft cost the capacity manager prices, and that ``profile-sps`` measures, is a real drafter's;
* per request and position k it draws a **latent acceptance probability** ``a_k``:
  ``logit(a_k) = logit(b_k) + spread * (sqrt(1/2) z_r + sqrt(1/2) z_rk)``, ``z ~ N(0, 1)``, where ``b_k``
  is the block's decay (``first * decay^(k-1)``, or an explicit ``probs`` list) -- the median of ``a_k``.
  ``z_r`` is shared along the request's block (an easy continuation is easy at every position), ``z_rk``
  is the position's own; both are redrawn every step. The spread is what makes confidences worth having:
  with ``spread=0`` every request looks the same and no ranking can beat the position average;
* the reported **confidence** is informative but deliberately miscalibrated:
  ``c_k = sigmoid(logit(a_k) / temp + noise * eps)``. ``temp < 1`` is overconfident (the saturated heads
  real checkpoints ship with), ``temp > 1`` underconfident; STS undoes the temperature (its fit lands
  near ``1 / temp``) but not the noise, so calibration has something real, and not everything, to fix;
* **acceptance** is decided by the latent probability, not by the target: draft k is accepted iff it
  was admitted to verification, every earlier draft was accepted, and ``u_k < a_k`` (``u`` uniform,
  drawn with the latents). The request then emits its accepted draft tokens and the *target's* token
  (argmax, or a sample of its distribution) from the row after them -- the verify forward still runs
  over every admitted draft, so verification costs what it costs, and the KV of every emitted token is
  the KV the target computed for it. Capacity-pruned drafts are never accepted, so pruning costs
  acceptance exactly as the decay predicts (:func:`expected_accepted`).

Why the sampler decides, rather than a drafter that proposes the target's own token with probability
``a_k``: the drafter does not have the target's logits when it drafts. Deciding at verification gives
exactly the drawn acceptance while the draft and verify passes stay the real ones, unchanged.

**Speed-study mode, never for real outputs**: emitted tokens are whatever the (random) draft proposed,
not samples of the target's distribution, and the engine logs a warning saying so at start-up.

Everything per step is a handful of fixed-shape device ops outside the captured graphs (the draft loop
graph still produces the real tokens): one generator draw of ``[R, 2K + 1]`` normals and ``[R, K]``
uniforms, no host sync. The latent draws come from one engine-wide generator (``seed``), so a request's
own sampling seed fixes its emitted target tokens' uniforms but not its acceptance pattern.

Spec grammar (``--draft``)::

    synthetic[:KEY=VALUE[,KEY=VALUE...]]
    first=0.8     b_1, in (0, 1]                   decay=0.7   b_k = first * decay^(k-1), in (0, 1]
    last=X        instead of decay: b_K = X (decay fitted to the run's K)
    probs=a/b/c   explicit b_1..b_K ('/'-separated, at least K values; excludes first/decay/last)
    spread=1.0    logit-scale std of the per-request variation (>= 0)
    temp=0.5      confidence temperature (> 0)   noise=0.3   logit-scale confidence noise (>= 0)
    seed=N        latent generator seed (default: the engine's --seed)
    draft=NAME    the draft model that is run for its cost (default random:small); must come last,
                  everything after 'draft=' is the name (names may contain ':' and ',')

Defaults follow DeepSeek-V4-Flash's shape for K = 7: ``b_1 = 0.8`` (above 0.7) decaying to
``b_7 = 0.8 * 0.7^6 = 0.094`` (below 0.1).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dspark_cli.core.layout import VerifyLayout
from dspark_cli.core.rejection import RejectionOutput, sample
from dspark_cli.engines.embedded.drafter import ConfidenceHead, Drafter, DraftInputs, DraftOutput, ForwardFn
from dspark_cli.engines.embedded.model import LlamaForCausalLM
from dspark_cli.errors import DsparkError

__all__ = [
    "SYNTHETIC_PREFIX",
    "SyntheticDraw",
    "SyntheticDrafter",
    "SyntheticSpec",
    "draw_synthetic",
    "expected_accepted",
    "is_synthetic",
    "parse_synthetic",
    "synthetic_rejection_sample",
]

SYNTHETIC_PREFIX = "synthetic"
# Fraction of the latent logit variance shared by every position of a request's block.
SHARED_VARIANCE = 0.5
PROB_EPS = 1e-6
_KEYS = ("first", "decay", "last", "probs", "spread", "temp", "noise", "seed", "draft")
# ``draft=`` at the start or after a comma; everything after it is the draft's name.
_DRAFT_KEY = re.compile(r"(?:^|,)\s*draft\s*=", re.IGNORECASE)


@dataclass(frozen=True)
class SyntheticSpec:
    """A parsed ``synthetic:...`` draft spec (see the module docstring for the meaning of each field)."""

    first: float = 0.8
    decay: float = 0.7
    last: float | None = None  # replaces decay: b_K = last, the decay fitted to the run's K
    probs: tuple[float, ...] | None = None
    spread: float = 1.0
    temp: float = 0.5
    noise: float = 0.3
    seed: int | None = None
    draft: str = "random:small"

    def base_probs(self, num_spec: int) -> list[float]:
        """Median latent acceptance ``b_1..b_K`` for a run with ``K = num_spec``."""
        if num_spec < 1:
            return []
        if self.probs is not None:
            if len(self.probs) < num_spec:
                raise DsparkError(
                    f"synthetic draft: probs= gives {len(self.probs)} positions but K={num_spec}; "
                    f"list at least {num_spec} values (or lower --num-speculative-tokens)"
                )
            return list(self.probs[:num_spec])
        decay = self.decay
        if self.last is not None:
            decay = (self.last / self.first) ** (1.0 / (num_spec - 1)) if num_spec > 1 else 1.0
        return [self.first * decay**k for k in range(num_spec)]

    def describe(self, num_spec: int) -> str:
        probs = "/".join(f"{p:.3g}" for p in self.base_probs(num_spec))
        return (f"b_k={probs}, spread={self.spread:g}, temp={self.temp:g}, noise={self.noise:g}, "
                f"draft={self.draft}")


def is_synthetic(name: object) -> bool:
    """``synthetic`` or ``synthetic:...`` (case-insensitive); anything else is a real draft name."""
    if not isinstance(name, str):
        return False
    head = name.strip().lower()
    return head == SYNTHETIC_PREFIX or head.startswith(SYNTHETIC_PREFIX + ":")


def _number(key: str, text: str, lo: float, hi: float | None, lo_open: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise DsparkError(f"synthetic draft: {key}={text!r} is not a number") from None
    bad_lo = value <= lo if lo_open else value < lo
    if not math.isfinite(value) or bad_lo or (hi is not None and value > hi):
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if hi is not None else f"{'>' if lo_open else '>='} {lo:g}"
        raise DsparkError(f"synthetic draft: {key} must be {'in ' if hi is not None else ''}{rng}, got {text}")
    return value


def parse_synthetic(text: str) -> SyntheticSpec:
    """Parse ``synthetic[:k=v,...]`` into a spec; one-line :class:`DsparkError` for anything malformed."""
    if not is_synthetic(text):
        raise DsparkError(f"{text!r} is not a synthetic draft spec; use synthetic or synthetic:KEY=VALUE,...")
    body = text.strip()[len(SYNTHETIC_PREFIX):]
    if not body:
        return SyntheticSpec()
    body = body[1:]  # the ':'
    draft: str | None = None
    found = _DRAFT_KEY.search(body)
    if found is not None:
        body, draft = body[: found.start()], body[found.end():].strip()
        if not draft:
            raise DsparkError("synthetic draft: draft= needs a model name, e.g. draft=random:small:layers=2")
        if is_synthetic(draft) or draft.lower() == "none":
            raise DsparkError(f"synthetic draft: draft={draft} must name a real draft model (random:small, auto, a dir)")
    values: dict[str, str] = {}
    for item in (body.split(",") if body else []):
        key, eq, value = item.partition("=")
        key = key.strip().lower()
        if not eq or not key or not value.strip():
            raise DsparkError(f"synthetic draft: {item!r} is not KEY=VALUE; e.g. synthetic:first=0.8,decay=0.7")
        if key not in _KEYS:
            raise DsparkError(f"synthetic draft: unknown key {key!r}; use {', '.join(_KEYS)}")
        if key in values:
            raise DsparkError(f"synthetic draft: {key} is given twice")
        values[key] = value.strip()
    kwargs: dict[str, object] = {}
    if "probs" in values:
        clash = [k for k in ("first", "decay", "last") if k in values]
        if clash:
            raise DsparkError(f"synthetic draft: probs= sets every position; drop {', '.join(clash)}")
        parts = values["probs"].split("/")
        kwargs["probs"] = tuple(_number("probs", p.strip(), 0.0, 1.0, True) for p in parts)
    if "decay" in values and "last" in values:
        raise DsparkError("synthetic draft: give decay= or last=, not both (last= fits the decay to K)")
    if "first" in values:
        kwargs["first"] = _number("first", values["first"], 0.0, 1.0, True)
    if "decay" in values:
        kwargs["decay"] = _number("decay", values["decay"], 0.0, 1.0, True)
    if "last" in values:
        kwargs["last"] = _number("last", values["last"], 0.0, 1.0, True)
        if kwargs["last"] > float(kwargs.get("first", SyntheticSpec.first)):  # type: ignore[arg-type]
            raise DsparkError(f"synthetic draft: last={values['last']} exceeds first; acceptance decays along "
                              "the block (use probs= for other shapes)")
    for key in ("spread", "noise"):
        if key in values:
            kwargs[key] = _number(key, values[key], 0.0, None, False)
    if "temp" in values:
        kwargs["temp"] = _number("temp", values["temp"], 0.0, None, True)
    if "seed" in values:
        if not values["seed"].isdigit():
            raise DsparkError(f"synthetic draft: seed must be a non-negative integer, got {values['seed']}")
        kwargs["seed"] = int(values["seed"])
    if draft is not None:
        kwargs["draft"] = draft
    return SyntheticSpec(**kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ draws


@dataclass
class SyntheticDraw:
    latent: Tensor  # [R, K] float32: a_k, the probability that draft k is accepted given 1..k-1 were
    confidence: Tensor  # [R, K] float32: the miscalibrated estimate of a_k the drafter reports
    accept: Tensor  # [R, K] bool: u_k < a_k (before capacity pruning and the prefix rule)


def draw_synthetic(
    base_logit: Tensor, num_reqs: int, spec: SyntheticSpec, generator: torch.Generator | None = None
) -> SyntheticDraw:
    """One step's latents, confidences and Bernoulli outcomes for ``num_reqs`` requests (device, no sync)."""
    k = base_logit.shape[0]
    dev = base_logit.device
    z = torch.randn(num_reqs, 2 * k + 1, device=dev, generator=generator)
    u = torch.rand(num_reqs, k, device=dev, generator=generator)
    shared, own, eps = z[:, :1], z[:, 1 : k + 1], z[:, k + 1 :]
    logit_a = base_logit + spec.spread * (math.sqrt(SHARED_VARIANCE) * shared + math.sqrt(1.0 - SHARED_VARIANCE) * own)
    latent = torch.sigmoid(logit_a)
    confidence = torch.sigmoid(logit_a / spec.temp + spec.noise * eps)
    return SyntheticDraw(latent=latent, confidence=confidence, accept=u < latent)


def _logit(p: list[float] | np.ndarray) -> np.ndarray:
    q = np.clip(np.asarray(p, dtype=np.float64), PROB_EPS, 1.0 - PROB_EPS)
    return np.log(q) - np.log1p(-q)


def expected_accepted(spec: SyntheticSpec, num_spec: int, samples: int = 200_000, seed: int = 0) -> np.ndarray:
    """``E[accepted drafts | v verified]`` for ``v = 0..K`` under the spec's latent distribution.

    Accepted drafts given ``v`` admitted: ``sum_{k <= v} prod_{j <= k} a_j``, in expectation over the
    latents -- exact for ``spread == 0``, Monte Carlo (``samples`` draws) otherwise. ``[K]`` is the mean
    acceptance of a run that verifies every draft; 1 + that is vLLM's "mean acceptance length".
    """
    base = _logit(spec.base_probs(num_spec))
    if spec.spread == 0:
        a = 1.0 / (1.0 + np.exp(-base))[None, :]
    else:
        rng = np.random.default_rng(seed)
        z0 = rng.standard_normal((samples, 1))
        zk = rng.standard_normal((samples, num_spec))
        logit_a = base + spec.spread * (math.sqrt(SHARED_VARIANCE) * z0 + math.sqrt(1.0 - SHARED_VARIANCE) * zk)
        a = 1.0 / (1.0 + np.exp(-logit_a))
    survival = np.cumprod(a, axis=1).mean(axis=0)  # P(first k accepted | all k verified)
    return np.concatenate([[0.0], np.cumsum(survival)])


# ------------------------------------------------------------------------------------------ drafter


class SyntheticDrafter(Drafter):
    """A :class:`Drafter` whose tokens come from a real (small) draft model and whose confidences and
    acceptance come from :func:`draw_synthetic`; the engine then verifies with
    :func:`synthetic_rejection_sample` (``DraftOutput.accept`` carries the draws to it)."""

    def __init__(
        self, model: LlamaForCausalLM, conf_head: ConfidenceHead | None, forward: ForwardFn,
        step_forward: ForwardFn | None, spec: SyntheticSpec, num_spec: int, device: torch.device, seed: int,
    ) -> None:
        super().__init__(model, conf_head, forward, step_forward)
        self.spec = spec
        self.base_logit = torch.tensor(_logit(spec.base_probs(num_spec)), dtype=torch.float32, device=device)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def propose(self, inp: DraftInputs, num_tokens: int) -> DraftOutput:
        real = super().propose(inp, num_tokens)
        # The real pass's confidences (head or q(x)) were computed as a real drafter computes them, so the
        # step costs what it would; only their values are replaced.
        draw = draw_synthetic(self.base_logit[:num_tokens], real.tokens.shape[0], self.spec, self.generator)
        return DraftOutput(tokens=real.tokens, confidence=draw.confidence, draft_probs=real.draft_probs,
                           latent=draw.latent, accept=draw.accept)


# ------------------------------------------------------------------------------------------ verification


RowMap = VerifyLayout | tuple[Tensor, Tensor, Tensor]


def synthetic_rejection_sample(
    logits: Tensor,
    rows: RowMap,
    drafts: Tensor,
    admitted: Tensor,
    accept: Tensor,
    temperature: Tensor | None = None,
    top_p: Tensor | None = None,
    uniforms: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> RejectionOutput:
    """``core.rejection.rejection_sample`` with acceptance decided by ``accept[R, K]`` instead of the target.

    Request ``r`` accepts its first ``n`` drafts, ``n`` = the longest prefix with ``accept`` set and
    ``k < admitted[r]`` (pruned drafts are never accepted), and emits them followed by the target's token
    from its slot-``n`` row: the argmax, or for sampling requests a draw from the target's sampling
    distribution with ``uniforms[row, 1]`` (the column the real sampler emits with). Same arguments and
    output as the real sampler, fixed shapes, no host sync. The argmax is taken over every row -- one full
    read of the logits, as the real sampler's row pass does -- so the step keeps a real sampler's cost.
    """
    if isinstance(rows, VerifyLayout):
        req_index, pos_in_req, valid = rows.req_index, rows.pos_in_req, ~rows.is_padding
    else:
        req_index, pos_in_req, valid = rows
    num_reqs, num_spec = drafts.shape
    num_rows = logits.shape[0]
    device = logits.device
    width = num_spec + 1
    adm = admitted.to(torch.int64).clamp(0, num_spec)
    cols = torch.arange(num_spec, device=device, dtype=torch.int64)
    acc = accept.to(torch.bool) & (cols.unsqueeze(0) < adm.unsqueeze(1))
    num_accepted = torch.cumprod(acc.to(torch.int64), dim=1).sum(dim=1)

    # Which logits row holds slot (r, num_accepted[r]): scatter row ids into the [R, K + 1] slot grid.
    req_raw = req_index.to(torch.int64)
    pos = pos_in_req.to(torch.int64)
    req = req_raw.clamp(0, num_reqs - 1)
    valid = valid.to(torch.bool) & (req_raw >= 0) & (req_raw < num_reqs) & (pos >= 0) & (pos <= adm[req])
    dump = num_reqs * width
    slot = torch.where(valid, req * width + pos.clamp(0, num_spec), dump)
    rows_idx = torch.arange(num_rows, device=device, dtype=torch.int64)
    row_of_slot = torch.zeros(dump + 1, dtype=torch.int64, device=device).scatter_(0, slot, rows_idx)
    req_ar = torch.arange(num_reqs, device=device, dtype=torch.int64)
    emit_row = row_of_slot[req_ar * width + num_accepted]

    emitted = logits.argmax(dim=-1)[emit_row]
    if temperature is not None:
        u = uniforms[emit_row, 1] if uniforms is not None else None
        emitted = sample(logits[emit_row], temperature, top_p, u, generator)

    drafts_ext = torch.cat([drafts.to(torch.int64), torch.zeros_like(drafts[:, :1], dtype=torch.int64)], dim=1)
    all_cols = torch.arange(width, device=device, dtype=torch.int64).unsqueeze(0)
    na = num_accepted.unsqueeze(1)
    tokens = torch.where(all_cols < na, drafts_ext, torch.where(all_cols == na, emitted.unsqueeze(1), -1))
    return RejectionOutput(tokens=tokens, num_accepted=num_accepted, num_emitted=num_accepted + 1)

