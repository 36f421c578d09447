"""Decoder-only (or bidirectional) pre-LayerNorm transformer with a pluggable attention core.

Dimension letters (NanoDO): B batch, T sequence, D model width, H heads, K head width,
F MLP width, V vocabulary (or output classes), L layers, I continuous input features.
"""

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm import attention, sharding

POSITIONS = ("rotary", "relative_bias", "learned", "none")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  V: int                      # vocabulary size, or number of output classes / regression targets
  D: int = 128
  H: int = 4
  L: int = 2
  F: int = 512
  qkv_dim: int = 0            # total q/k/v width over heads; 0 means D (K = qkv_dim / H)
  attention: str = "softmax"  # a name in lm.attention.PRESETS
  attention_impl: str = "auto"      # a name in lm.attention.IMPLS; auto picks the fastest per platform
  attention_dropout: float = 0.0
  causal: bool = True
  positions: str = "rotary"
  max_len: int = 2048         # learned positions only
  rope_base: float = 10_000.0
  relative_buckets: int = 32
  relative_max_distance: int = 128
  relative_bidirectional: bool = True   # False: later keys share the query's bucket 0 (the paper's code)
  relative_bias_per_layer: bool = False  # one bias table per layer (the paper's code) or one shared (T5)
  tied_embeddings: bool = False
  input_dim: int = 0          # >0: inputs are float vectors of this width instead of token ids
  dtype: str = "float32"      # compute dtype; parameters stay float32
  remat: bool = False

  def __post_init__(self):
    attention.check_knobs(**self.knobs, impl=self.attention_impl)
    qkv = self.qkv_dim or self.D
    if qkv % self.H:
      raise ValueError(f"q/k/v width {qkv} is not divisible by {self.H} heads; "
                       f"set model.H to a divisor of {qkv} or change model.qkv_dim / model.D")
    if self.positions not in POSITIONS:
      raise ValueError(f"unknown model.positions {self.positions!r}; choose one of: {', '.join(POSITIONS)}")
    if self.dtype not in DTYPES:
      raise ValueError(f"unknown model.dtype {self.dtype!r}; choose one of: {', '.join(DTYPES)}")
    if self.positions == "relative_bias" and self.relative_max_distance < self.relative_buckets:
      raise ValueError(f"model.relative_max_distance={self.relative_max_distance} must be at least "
                       f"model.relative_buckets={self.relative_buckets}")
    if self.positions == "rotary" and (qkv // self.H) % 2:
      raise ValueError(f"rotary positions need an even head width, got {qkv // self.H}")

  @classmethod
  def from_dict(cls, fields: dict[str, Any]) -> "ModelConfig":
    unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"unknown model config field(s): {', '.join(sorted(unknown))}")
    return cls(**fields)

  @property
  def knobs(self) -> dict[str, str]:
    return attention.preset(self.attention)

  @property
  def K(self) -> int:
    return (self.qkv_dim or self.D) // self.H


def _init(stddev: float):
  return nn.initializers.normal(stddev=stddev)


def rotary(x_bthk: jax.Array, positions_bt: jax.Array, base: float) -> jax.Array:
  """Rotates pairs (x[i], x[i + K/2]) by angle position / base^(2i/K)."""
  half = x_bthk.shape[-1] // 2
  freq_k = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle_bt1k = positions_bt[:, :, None, None].astype(jnp.float32) * freq_k
  sin, cos = jnp.sin(angle_bt1k), jnp.cos(angle_bt1k)
  x1, x2 = jnp.split(x_bthk.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_bthk.dtype)


def relative_bucket(relative_bqk: jax.Array, *, bidirectional: bool, num_buckets: int,
                    max_distance: int) -> jax.Array:
  """T5's bucketing of key-minus-query offsets: exact for small offsets, logarithmic beyond.

  One-sided (not bidirectional): every key after the query falls in bucket 0 with the query itself.
  """
  bucket = jnp.zeros_like(relative_bqk)
  if not bidirectional:
    n = jnp.maximum(-relative_bqk, 0)
  else:
    num_buckets //= 2
    bucket = jnp.where(relative_bqk > 0, num_buckets, 0)
    n = jnp.abs(relative_bqk)
  max_exact = num_buckets // 2
  log_bucket = max_exact + (
      jnp.log(jnp.maximum(n, 1) / max_exact) / math.log(max_distance / max_exact)
      * (num_buckets - max_exact)).astype(jnp.int32)
  log_bucket = jnp.minimum(log_bucket, num_buckets - 1)
  return bucket + jnp.where(n < max_exact, n, log_bucket)


class Attention(nn.Module):
  cfg: ModelConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x_btd, positions_bt, segment_ids_bt, bias_bhqk, return_codes: bool):
    cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
    D, H, K = cfg.D, cfg.H, cfg.K
    init = _init(D ** -0.5)
    w = {n: self.param(n, init, (D, H, K)).astype(dtype) for n in ("wq", "wk", "wv")}
    wo_hkd = self.param("wo", _init((H * K * 2 * cfg.L) ** -0.5), (H, K, D)).astype(dtype)
    q_bthk, k_bthk, v_bthk = (jnp.einsum("btd,dhk->bthk", x_btd, w[n]) for n in ("wq", "wk", "wv"))
    if cfg.positions == "rotary":
      q_bthk = rotary(q_bthk, positions_bt, cfg.rope_base)
      k_bthk = rotary(k_bthk, positions_bt, cfg.rope_base)
    knobs = cfg.knobs
    dropout = cfg.attention_dropout > 0 and not self.deterministic
    codes = None
    if return_codes or dropout:
      # The materialised path: needed to hand back scores or drop them; never on the fast path.
      a_bhqk = attention.normalized_scores(
          q_bthk, k_bthk, normalization=knobs["normalization"], causal=cfg.causal,
          segment_ids=segment_ids_bt, bias=bias_bhqk)
      codes = a_bhqk if return_codes else None
      if dropout:
        # One mask shared over batch and heads, as in the paper's reference code.
        keep_11qk = jax.random.bernoulli(self.make_rng("dropout"), 1 - cfg.attention_dropout,
                                         (1, 1) + a_bhqk.shape[2:])
        a_bhqk = jnp.where(keep_11qk, a_bhqk / (1 - cfg.attention_dropout), 0.0)
      out_bthk = attention.apply_value_network(
          a_bhqk, v_bthk, value_network=knobs["value_network"],
          nonlinearity=knobs["nonlinearity"]).astype(dtype)
    else:
      out_bthk = attention.attend(q_bthk, k_bthk, v_bthk, **knobs, causal=cfg.causal,
                                  segment_ids=segment_ids_bt, bias=bias_bhqk,
                                  impl=cfg.attention_impl)
    return jnp.einsum("bthk,hkd->btd", out_bthk, wo_hkd), codes


class Mlp(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_btd):
    cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
    wi_df = self.param("wi", _init(cfg.D ** -0.5), (cfg.D, cfg.F)).astype(dtype)
    wo_fd = self.param("wo", _init((cfg.F * 2 * cfg.L) ** -0.5), (cfg.F, cfg.D)).astype(dtype)
    return jax.nn.gelu(x_btd @ wi_df) @ wo_fd


class Block(nn.Module):
  cfg: ModelConfig
  deterministic: bool = True
  return_codes: bool = False

  @nn.compact
  def __call__(self, x_btd, positions_bt, segment_ids_bt, bias_bhqk):
    dtype = DTYPES[self.cfg.dtype]
    h_btd, codes = Attention(self.cfg, self.deterministic, name="attn")(
        nn.LayerNorm(dtype=dtype, name="ln_attn")(x_btd), positions_bt, segment_ids_bt, bias_bhqk,
        self.return_codes)
    x_btd = x_btd + h_btd
    x_btd = x_btd + Mlp(self.cfg, name="mlp")(nn.LayerNorm(dtype=dtype, name="ln_mlp")(x_btd))
    return x_btd, codes


class Transformer(nn.Module):
  """inputs: token ids [B, T] (or float features [B, T, I] when cfg.input_dim > 0).

  Returns float32 outputs [B, T, V] and, with return_codes, each layer's normalised scores
  [B, H, T, T] (the latent codes); otherwise None in their place.
  """
  cfg: ModelConfig

  @nn.compact
  def __call__(self, inputs, *, positions_bt=None, segment_ids_bt=None, deterministic: bool = True,
               return_codes: bool = False):
    cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
    B, T = inputs.shape[:2]
    if positions_bt is None:
      positions_bt = jnp.broadcast_to(jnp.arange(T), (B, T))
    if cfg.input_dim:
      w_id = self.param("input_proj", _init(cfg.input_dim ** -0.5), (cfg.input_dim, cfg.D))
      x_btd = inputs.astype(dtype) @ w_id.astype(dtype)
    else:
      embed_vd = self.param("embed", _init(1.0), (cfg.V, cfg.D))
      x_btd = embed_vd.astype(dtype)[inputs]
    if cfg.positions == "learned":
      x_btd = x_btd + self.param("pos_embed", _init(0.02), (cfg.max_len, cfg.D)).astype(dtype)[positions_bt]
    bias_bhqk = None
    if cfg.positions == "relative_bias":
      bucket_bqk = relative_bucket(positions_bt[:, None, :] - positions_bt[:, :, None],
                                   bidirectional=cfg.relative_bidirectional and not cfg.causal,
                                   num_buckets=cfg.relative_buckets,
                                   max_distance=cfg.relative_max_distance)
      relative_bias = lambda name: jnp.moveaxis(
          self.param(name, _init(0.02), (cfg.relative_buckets, cfg.H))[bucket_bqk], -1, 1)
      if not cfg.relative_bias_per_layer:
        bias_bhqk = relative_bias("relative_bias")  # one table shared by all layers, as in T5
    block = nn.remat(Block) if cfg.remat else Block
    codes = []
    x_btd = sharding.constrain_batch(x_btd)
    for i in range(cfg.L):
      if cfg.positions == "relative_bias" and cfg.relative_bias_per_layer:
        bias_bhqk = relative_bias(f"relative_bias_{i}")
      x_btd, codes_i = block(cfg, deterministic, return_codes, name=f"block_{i}")(
          x_btd, positions_bt, segment_ids_bt, bias_bhqk)
      x_btd = sharding.constrain_batch(x_btd)
      codes.append(codes_i)
    x_btd = nn.LayerNorm(dtype=dtype, name="ln_final")(x_btd)
    if cfg.tied_embeddings and not cfg.input_dim:
      out_btv = x_btd @ embed_vd.astype(dtype).T * cfg.D ** -0.5
    else:
      out_btv = x_btd @ self.param("unembed", _init(cfg.D ** -0.5), (cfg.D, cfg.V)).astype(dtype)
    return out_btv.astype(jnp.float32), (codes if return_codes else None)


def count_params(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))
