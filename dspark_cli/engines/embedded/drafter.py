"""The draft model: proposes K tokens per request autoregressively, with a confidence per token.

A draft is a smaller Llama sharing the target's tokenizer, with its own paged KV cache indexed by the same
block tables as the target's. One proposal is K forward passes:

1. a **catch-up** pass feeds every token the draft has not seen yet -- normally the bonus token, plus the
   last draft when all K were accepted (the draft never fed its own K-th proposal), more after drafting
   was paused -- and its last row's distribution gives draft 1;
2. K - 1 one-token passes feed draft k to get draft k + 1.

KV the draft wrote for drafts that were later rejected lies beyond the sequence's draft frontier and is
overwritten by the next catch-up pass (positions are rewritten, never appended).

**Confidence** ``c_k`` estimates the probability that draft k is accepted given drafts 1..k-1 were. If
the draft checkpoint carries a ``confidence_head`` (``weight [1, hidden + 2]``, ``bias [1]``), c_k =
sigmoid(head(concat(h_k, log q(x_k), H(q)))) where h_k is the final-normed hidden state that produced
draft k's distribution, and q is the draft's *temperature-1* distribution (one head for every request
temperature). Without a head, c_k = q(x_k): the draft's own probability of its token, a head-less
estimate that is usually miscalibrated -- STS is what turns it into a usable survival.

Tokens are drawn from the request's sampling distribution (greedy = argmax, else softmax(logits / T), no
top-p: the rejection sampler is lossless for any draft distribution as long as it is told which one);
``draft_probs [R, K, V]`` is returned only when some request samples.

``synthetic.SyntheticDrafter`` (``--draft synthetic:...``, speed studies only) subclasses :class:`Drafter`:
the same real draft pass, then drawn confidences and acceptance outcomes in place of the real ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dspark_cli.core.rejection import apply_sampling_params, inverse_cdf_sample
from dspark_cli.engines.embedded.model import LlamaForCausalLM
from dspark_cli.errors import DsparkError

__all__ = ["ConfidenceHead", "DraftInputs", "DraftOutput", "Drafter", "load_confidence_head"]


class ConfidenceHead(nn.Module):
    """sigmoid(W [h; log q(x); H(q)] + b): the checkpoint's learned per-token acceptance estimate."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size + 2, 1)

    def forward(self, hidden: Tensor, logq_x: Tensor, entropy: Tensor) -> Tensor:
        feats = torch.cat([hidden.float(), logq_x.unsqueeze(-1), entropy.unsqueeze(-1)], dim=-1)
        return torch.sigmoid(self.proj(feats).squeeze(-1))


def load_confidence_head(
    tensors: dict[str, Tensor], hidden_size: int, device: torch.device, source: str
) -> ConfidenceHead | None:
    """The checkpoint's ``confidence_head.{weight,bias}`` as a float32 module, or None when absent."""
    weight = tensors.get("confidence_head.weight")
    if weight is None:
        return None
    if tuple(weight.shape) != (1, hidden_size + 2):
        raise DsparkError(
            f"{source}: confidence_head.weight has shape {tuple(weight.shape)}, expected [1, {hidden_size + 2}]"
        )
    head = ConfidenceHead(hidden_size)
    bias = tensors.get("confidence_head.bias")
    with torch.no_grad():
        head.proj.weight.copy_(weight.float())
        head.proj.bias.copy_(bias.float().reshape(1) if bias is not None else torch.zeros(1))
    return head.to(device).eval().requires_grad_(False)


# (input_ids, positions, req_index, is_padding, query_start_pos, block_tables, max_query_len, max_kv_len)
ForwardFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int, int], Tensor]
# (h, next_pos, block_tables, temperature, uniforms) -> (tokens, confidences, draft distributions or None)
LoopFn = Callable[..., tuple[Tensor, Tensor, Tensor | None] | None]


@dataclass
class DraftInputs:
    """One proposal's batch, all device tensors except the host ints."""

    catchup_ids: Tensor  # [T0] tokens the draft has not fed yet, request-major
    catchup_positions: Tensor  # [T0]
    catchup_req: Tensor  # [T0] owning request
    catchup_last: Tensor  # [R] row of each request's last catch-up token (its logits give draft 1)
    catchup_start: Tensor  # [R] position of each request's first catch-up token
    next_pos: Tensor  # [R] position of draft 1 (= sequence length)
    block_tables: Tensor  # [R, max_blocks]
    temperature: Tensor | None  # [R] (<= 0 greedy); None = every request greedy (host-known)
    uniforms: Tensor | None  # [R, K] in [0, 1) for sampling requests
    max_catchup: int  # host: longest catch-up
    max_kv_len: int  # host: keys to gather (multiple of block_size)


@dataclass
class DraftOutput:
    tokens: Tensor  # [R, K] int64
    confidence: Tensor  # [R, K] float32, raw (before STS)
    draft_probs: Tensor | None  # [R, K, V] float32 sampling distributions, None when all greedy
    # Synthetic drafter only (synthetic.py; speed studies): the latent acceptance probabilities a_k and the
    # drawn outcomes u_k < a_k that decide acceptance in place of the target. None for a real drafter.
    latent: Tensor | None = None  # [R, K] float32
    accept: Tensor | None = None  # [R, K] bool

    def spread(self, rows: Tensor, num_reqs: int) -> DraftOutput:
        """This proposal for a sample of a batch (its row i is the batch's row ``rows[i]``) as the whole batch's:
        the other rows hold zeros -- token 0, confidence 0, acceptance False -- and are given no draft to verify.
        Draft distributions stay zero there too: the rejection sampler reads a row's only where it verifies one."""

        def full(t: Tensor | None) -> Tensor | None:
            if t is None:
                return None
            out = torch.zeros((num_reqs, *t.shape[1:]), dtype=t.dtype, device=t.device)
            return out.index_copy_(0, rows, t)

        spread = full(self.tokens)
        assert spread is not None
        conf = full(self.confidence)
        assert conf is not None
        return DraftOutput(spread, conf, full(self.draft_probs), full(self.latent), full(self.accept))


class Drafter:
    def __init__(
        self, model: LlamaForCausalLM, conf_head: ConfidenceHead | None, forward: ForwardFn,
        step_forward: ForwardFn | None = None,
    ) -> None:
        self.model = model
        self.conf_head = conf_head
        self._forward = forward  # catch-up pass (ragged)
        self._step_forward = step_forward or forward  # one token per request (CUDA graph per request count)
        # The whole greedy loop after the catch-up as one replay (CUDA graphs): (h, next_pos, tables) ->
        # (tokens, confidences, None), or None when no captured size fits. None = the eager loop below.
        self.loop_fn: LoopFn | None = None
        # The same for sampling batches: (h, next_pos, tables, temperature, uniforms) -> (tokens, confidences,
        # draft distributions [R, K, V]), or None.
        self.sampling_loop_fn: LoopFn | None = None

    @property
    def has_confidence_head(self) -> bool:
        return self.conf_head is not None

    def _confidence(self, hidden: Tensor, logits: Tensor, tokens: Tensor) -> Tensor:
        logq = torch.log_softmax(logits.float(), dim=-1)
        logq_x = logq.gather(1, tokens.unsqueeze(1)).squeeze(1)
        if self.conf_head is None:
            return logq_x.exp()
        entropy = -(logq.exp() * logq).sum(dim=-1)
        return self.conf_head(hidden, logq_x, entropy)

    @staticmethod
    def draw(logits: Tensor, temperature: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
        """One draft token per row and the distribution it was drawn from (``[R, V]`` float32): inverse-CDF
        sampling of softmax(logits / T) with ``u``, argmax where T <= 0. The rejection sampler is told this
        distribution, so any rule works as long as the token is drawn from it; the CUDA-graphed loop and
        the eager loop both call this, so they draw identical tokens."""
        probs = apply_sampling_params(logits, temperature, None).softmax(dim=-1)
        tokens = torch.where(temperature > 0, inverse_cdf_sample(probs, u), logits.argmax(dim=-1))
        return tokens, probs

    def _sample(self, logits: Tensor, inp: DraftInputs, k: int) -> tuple[Tensor, Tensor | None]:
        if inp.temperature is None:
            return logits.argmax(dim=-1), None
        if inp.uniforms is None:
            u = torch.rand(logits.shape[0], device=logits.device)
        else:
            u = inp.uniforms[:, k]
        return self.draw(logits, inp.temperature, u)

    @torch.inference_mode()
    def propose(self, inp: DraftInputs, num_tokens: int) -> DraftOutput:
        num_reqs = inp.catchup_last.shape[0]
        device = inp.catchup_ids.device
        no_pad = torch.zeros_like(inp.catchup_ids, dtype=torch.bool)
        hidden = self._forward(
            inp.catchup_ids, inp.catchup_positions, inp.catchup_req, no_pad, inp.catchup_start,
            inp.block_tables, inp.max_catchup, inp.max_kv_len,
        )
        h = hidden[inp.catchup_last]
        if num_tokens > 0:
            looped = None
            if inp.temperature is None and self.loop_fn is not None:
                looped = self.loop_fn(h, inp.next_pos, inp.block_tables)
            elif inp.temperature is not None and inp.uniforms is not None and self.sampling_loop_fn is not None:
                looped = self.sampling_loop_fn(h, inp.next_pos, inp.block_tables, inp.temperature, inp.uniforms)
            if looped is not None:
                return DraftOutput(tokens=looped[0], confidence=looped[1], draft_probs=looped[2])
        tokens, confs, probs = [], [], []
        req_ar = torch.arange(num_reqs, device=device)
        step_pad = torch.zeros(num_reqs, dtype=torch.bool, device=device)
        for k in range(num_tokens):
            logits = self.model.compute_logits(h)
            tok, p = self._sample(logits, inp, k)
            tokens.append(tok)
            confs.append(self._confidence(h, logits, tok))
            if p is not None:
                probs.append(p)
            if k + 1 == num_tokens:
                break
            pos = inp.next_pos + k
            h = self._step_forward(tok, pos, req_ar, step_pad, pos, inp.block_tables, 1, inp.max_kv_len)
        return DraftOutput(
            tokens=torch.stack(tokens, dim=1),
            confidence=torch.stack(confs, dim=1).float(),
            draft_probs=torch.stack(probs, dim=1) if probs else None,
        )

    @torch.inference_mode()
    def prefill(
        self, input_ids: Tensor, positions: Tensor, req_index: Tensor, query_start: Tensor, block_tables: Tensor,
        max_query_len: int, max_kv_len: int,
    ) -> None:
        """Write the draft's KV for a prefill batch (its logits are not needed: the target samples)."""
        no_pad = torch.zeros_like(input_ids, dtype=torch.bool)
        self._forward(input_ids, positions, req_index, no_pad, query_start, block_tables, max_query_len, max_kv_len)
