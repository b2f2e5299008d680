"""Llama-family decoder over flattened ragged token batches with a paged KV cache.

Our own forward (RMSNorm, RoPE with default/linear/llama3 scaling, GQA, SwiGLU, optional tied
embeddings) so that a prefill, a ragged verify batch and a one-token draft step are all the same call:
``forward(input_ids[T], positions[T], kv_caches, attention_inputs) -> hidden[T, D]``. Weights load from
Hugging Face safetensors by their HF names; q/k/v and gate/up are fused at load time (two GEMMs per layer
instead of five matter for small batches).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn

from dspark_cli.engines.embedded.attention import AttentionBackend, AttentionInputs
from dspark_cli.errors import DsparkError

__all__ = ["LlamaArgs", "LlamaForCausalLM", "load_llama", "read_llama_args"]


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]


def _ids(value: object) -> tuple[int, ...]:
    """A config's ``eos_token_id``: one id, a list of them, or none."""
    if isinstance(value, list):
        return tuple(int(e) for e in value)
    return () if value is None else (int(value),)  # type: ignore[call-overload]


def read_llama_args(checkpoint: Path) -> LlamaArgs:
    """Parse ``config.json`` of a Llama-family checkpoint (transformers 4.x and 5.x spellings)."""
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        raise DsparkError(f"{checkpoint}: no config.json; pass a Hugging Face checkpoint directory")
    cfg = json.loads(path.read_text())
    model_type = cfg.get("model_type", "llama")
    if model_type not in ("llama", "mistral"):
        raise DsparkError(f"{path}: model_type {model_type!r} is not Llama-family; the embedded engine runs Llama")
    if cfg.get("hidden_act", "silu") != "silu":
        raise DsparkError(f"{path}: hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = dict(rope)
    eos_ids = _ids(cfg.get("eos_token_id"))
    # An instruct checkpoint may name its end-of-turn tokens only in generation_config.json (Llama-3's
    # <|eot_id|>); vLLM stops on those too, and without them a chat reply ran on to max_tokens.
    gen_path = Path(checkpoint) / "generation_config.json"
    if gen_path.is_file():
        try:
            gen = json.loads(gen_path.read_text())
        except (OSError, ValueError) as exc:
            raise DsparkError(f"{gen_path}: not readable JSON ({exc})") from None
        if isinstance(gen, dict):
            eos_ids += tuple(i for i in _ids(gen.get("eos_token_id")) if i not in eos_ids)
    return LlamaArgs(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        eos_token_ids=eos_ids,
    )


def rope_inv_freq(args: LlamaArgs) -> Tensor:
    """Inverse frequencies, float32, with the checkpoint's scaling applied (as transformers computes them)."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = args.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise DsparkError(f"rope scaling type {kind!r} is not supported by the embedded engine (default, linear, llama3)")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 like transformers, then cast back before the weight multiply.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF (non-interleaved) rotary embedding: x * cos + rotate_half(x) * sin; x [T, H, D], cos [T, D]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=args.attention_bias)
        self.scale = self.head_dim**-0.5
        self.backend = backend

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, inputs: AttentionInputs
    ) -> Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(-1, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, k_cache, v_cache, inputs, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.inter = args.intermediate_size
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, backend)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, inputs: AttentionInputs
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, inputs)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """``forward`` returns final-normed hidden states; ``compute_logits`` applies the LM head (float32)."""

    def __init__(self, args: LlamaArgs, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, backend) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # cos/sin table: a buffer, so it moves with .to(device) and a captured graph reads it in place.
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(args))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)

    def forward(
        self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]], inputs: AttentionInputs
    ) -> Tensor:
        x = self.embed_tokens(input_ids)
        cos = self.rope_cos[positions].to(x.dtype)
        sin = self.rope_sin[positions].to(x.dtype)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, k_cache, v_cache, inputs)
        return self.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> list[tuple[Tensor, Tensor]]:
        # Zero-filled: gathers read never-written slots under a mask, and 0 * NaN would poison them.
        shape = (num_blocks, block_size, self.args.num_kv_heads, self.args.head_dim)
        return [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(self.args.num_layers)
        ]

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.args.num_layers * block_size * self.args.num_kv_heads * self.args.head_dim * elem


def _checkpoint_files(checkpoint: Path) -> list[Path]:
    files = sorted(Path(checkpoint).glob("*.safetensors"))
    if not files:
        raise DsparkError(f"{checkpoint}: no *.safetensors weights; pass a Hugging Face safetensors checkpoint")
    return files


def read_safetensors(checkpoint: Path) -> dict[str, Tensor]:
    """All tensors of a checkpoint (single file or shards), by HF name, on CPU."""
    tensors: dict[str, Tensor] = {}
    for path in _checkpoint_files(checkpoint):
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                tensors[name] = fh.get_tensor(name)
    return tensors


def _hf_to_ours(args: LlamaArgs, hf: dict[str, Tensor], source: Path) -> dict[str, Tensor]:
    """Rename HF Llama weights to this module's layout, fusing q/k/v and gate/up."""

    def take(name: str) -> Tensor:
        if name not in hf:
            raise DsparkError(f"{source}: weight {name!r} missing from the checkpoint; is it a Llama model?")
        return hf[name]

    out: dict[str, Tensor] = {
        "embed_tokens.weight": take("model.embed_tokens.weight"),
        "norm.weight": take("model.norm.weight"),
    }
    if not args.tie_word_embeddings:
        out["lm_head.weight"] = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        q = f"layers.{i}."
        out[q + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
        out[q + "post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
        out[q + "self_attn.qkv_proj.weight"] = torch.cat(
            [take(p + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")], dim=0
        )
        if args.attention_bias:
            out[q + "self_attn.qkv_proj.bias"] = torch.cat(
                [take(p + f"self_attn.{n}_proj.bias") for n in ("q", "k", "v")], dim=0
            )
            out[q + "self_attn.o_proj.bias"] = take(p + "self_attn.o_proj.bias")
        out[q + "self_attn.o_proj.weight"] = take(p + "self_attn.o_proj.weight")
        out[q + "mlp.gate_up_proj.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0
        )
        out[q + "mlp.down_proj.weight"] = take(p + "mlp.down_proj.weight")
        if args.mlp_bias:
            out[q + "mlp.gate_up_proj.bias"] = torch.cat(
                [take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")], dim=0
            )
            out[q + "mlp.down_proj.bias"] = take(p + "mlp.down_proj.bias")
    return out


def load_llama(
    checkpoint: Path, backend: AttentionBackend, max_positions: int, dtype: torch.dtype, device: torch.device,
    hf_tensors: dict[str, Tensor] | None = None,
) -> LlamaForCausalLM:
    """Build the model from ``config.json`` and load its safetensors weights (extra tensors are ignored)."""
    checkpoint = Path(checkpoint)
    args = read_llama_args(checkpoint)
    from dspark_cli.engines.embedded.shapes import build_random_llama, random_init_spec

    random_spec = random_init_spec(checkpoint)
    if random_spec is not None:  # a weightless `random:<shape>` checkpoint: weights made on the device
        return build_random_llama(args, backend, max_positions, dtype, device, random_spec)
    hf = read_safetensors(checkpoint) if hf_tensors is None else hf_tensors
    with torch.device("meta"):
        model = LlamaForCausalLM(args, backend, max_positions)
    state = _hf_to_ours(args, hf, checkpoint)
    # Allocate directly in the target dtype (a float32 detour would double peak memory for big models).
    model = model.to_empty(device=device).to(dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=False)
    # lm_head is absent from the state when tied; the rope tables are recomputed rather than loaded.
    missing = [m for m in missing if m not in ("lm_head.weight",)]
    if missing or unexpected:
        raise DsparkError(f"{checkpoint}: weights do not match the config (missing {missing[:3]}, extra {unexpected[:3]})")
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(args))
    emb = torch.cat([freqs, freqs], dim=-1).to(device)
    model.rope_cos = emb.cos()  # float32 tables: positions up to max_model_len need the precision
    model.rope_sin = emb.sin()
    return model.eval().requires_grad_(False)
