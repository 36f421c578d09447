"""Decoder-only (or bidirectional) pre-LayerNorm transformer with a pluggable attention core.

Dimension letters (NanoDO): B batch, T sequence, D model width, H heads, K head width,
F MLP width, V vocabulary (or output classes), L layers, I continuous input features.
"""

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm import attention, cross_entropy, sharding
from lm.attention import decode_cache

POSITIONS = ("rotary", "relative_bias", "learned", "none")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# What the backward pass recomputes instead of reading back from memory (docs/results/compile_v5e.md).
REMATS = ("none", "mlp", "block")
# GLA's forget gate (Yang et al. 2024, section 4.4): log α = logsigmoid(x W1 W2 + b) / τ, W1 W2 of rank
# 16; the temperature τ = 16 keeps α near 1 at the start, so that the state forgets slowly.
GATE_RANK, GATE_TEMPERATURE = 16, 16.0
# Initial scale of the weights that write into the residual stream (attention and MLP outputs):
# 1/sqrt(fan-in x 2L) (GPT-2's depth scaling) or 1/sqrt(fan-in) (flax's default, the paper's code).
RESIDUAL_INITS = ("depth", "fan_in")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  V: int  # vocabulary size, or number of output classes / regression targets
  D: int = 128
  H: int = 4
  L: int = 2
  F: int = 512
  qkv_dim: int = 0  # total q/k/v width over heads; 0 means D (K = qkv_dim / H)
  attention: str = "softmax"  # a name in lm.attention.PRESETS, or one per layer (see layer_presets)
  attention_impl: str = "auto"  # a name in lm.attention.IMPLS; auto picks the fastest per platform
  attention_dropout: float = 0.0
  causal: bool = True
  positions: str = "rotary"
  max_len: int = 2048  # learned positions only
  rope_base: float = 10_000.0
  # Rotary: form each q and k coordinate's rotation partner by a second product, with the projection's
  # columns permuted to match (`rotary`), so the rotation is element-wise on the products' outputs and
  # XLA fuses it into them: less HBM traffic for a few more FLOPs (docs/results/compile_v5e.md). Right
  # for a step bound by HBM traffic in front of a Pallas attention kernel (configs/c4_50m.py sets it),
  # wrong for a CPU's compute-bound step and for linear attention's chunked XLA core (CPU and GPU),
  # which fuses the rotation into its own operations and then reads both products.
  rope_by_product: bool = False
  relative_buckets: int = 32
  relative_max_distance: int = 128
  relative_bidirectional: bool = True  # False: later keys share the query's bucket 0 (the paper's code)
  relative_bias_per_layer: bool = False  # one bias table per layer (the paper's code) or one shared (T5)
  relative_bias_std: float = 0.02  # initial std of the bias tables (the paper's code: buckets^-0.5)
  # Zero-initialised additive biases in the input, q/k/v, attention-output and MLP projections (the
  # paper's code, as flax's Dense). Not only offsets: a key bias adds q·b_k to every key's score, which
  # softmax cancels but unnormalised and rms_head attention keep.
  projection_bias: bool = False
  residual_init: str = "depth"  # a name in RESIDUAL_INITS
  tied_embeddings: bool = False
  input_dim: int = 0  # >0: inputs are float vectors of this width instead of token ids
  dtype: str = "float32"  # compute dtype; parameters stay float32
  # "bfloat16" with dtype float32: the dense products (projections, MLP) take bfloat16 operands and
  # give float32 results, forward and backward; everything else stays float32 (see `product`).
  # "" (or the compute dtype): products in the compute dtype.
  matmul_dtype: str = ""
  remat: str = "none"  # a name in REMATS

  def __post_init__(self):
    if self.remat not in REMATS:
      raise ValueError(f"unknown model.remat {self.remat!r}; choose one of: {', '.join(REMATS)}")
    if self.residual_init not in RESIDUAL_INITS:
      raise ValueError(f"unknown model.residual_init {self.residual_init!r}; "
                       f"choose one of: {', '.join(RESIDUAL_INITS)}")
    if not 0.0 <= self.attention_dropout < 1.0:
      raise ValueError(f"model.attention_dropout must be in [0, 1), got {self.attention_dropout}")
    for layer in range(self.L):
      attention.check(self.attention_impl, self.layer_knobs(layer), self.attention_call())
    qkv = self.qkv_dim or self.D
    if qkv % self.H:
      raise ValueError(f"q/k/v width {qkv} is not divisible by {self.H} heads; "
                       f"set model.H to a divisor of {qkv} or change model.qkv_dim / model.D")
    if self.positions not in POSITIONS:
      raise ValueError(f"unknown model.positions {self.positions!r}; choose one of: {', '.join(POSITIONS)}")
    if self.dtype not in DTYPES:
      raise ValueError(f"unknown model.dtype {self.dtype!r}; choose one of: {', '.join(DTYPES)}")
    if self.matmul_dtype not in ("", *DTYPES):
      raise ValueError(f"unknown model.matmul_dtype {self.matmul_dtype!r}; choose '' (model.dtype) or one "
                       f"of: {', '.join(DTYPES)}")
    if self.matmul_dtype == "float32" and self.dtype != "float32":
      raise ValueError(f"model.matmul_dtype='float32' needs model.dtype='float32': products take the "
                       f"compute dtype ({self.dtype!r}) or bfloat16 operands")
    if self.positions == "relative_bias" and self.relative_max_distance < self.relative_buckets:
      raise ValueError(f"model.relative_max_distance={self.relative_max_distance} must be at least "
                       f"model.relative_buckets={self.relative_buckets}")
    if self.positions == "rotary" and (qkv // self.H) % 2:
      raise ValueError(f"rotary positions need an even head width, got {qkv // self.H}")

  @classmethod
  def defaults(cls) -> dict[str, Any]:
    """Every field that has a default, with it: the one place model defaults live (configs/base.py
    builds its model section from this)."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}

  @classmethod
  def from_dict(cls, fields: dict[str, Any]) -> "ModelConfig":
    unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"unknown model config field(s): {', '.join(sorted(unknown))}")
    return cls(**fields)

  def layer_knobs(self, layer: int) -> "attention.Knobs":
    return attention.Knobs(**attention.preset(layer_presets(self.attention, self.L)[layer]))

  def attention_call(self, seq_len: int | None = None, segments: bool | None = None) -> "attention.Call":
    """What every layer's self-attention asks of an implementation at this length, with or without
    packed-document segments (None: not known)."""
    return attention.Call(seq_len, seq_len, self.causal, bias=self.positions == "relative_bias",
                          dropout=self.attention_dropout > 0, segments=segments, dtype=self.dtype,
                          head_dim=(self.qkv_dim or self.D) // self.H)

  def layer_impl(self, layer: int, seq_len: int, platform: str, segments: bool | None = None) -> str:
    """The implementation layer `layer` runs on `platform` at this length (auto resolved)."""
    if self.attention_impl != "auto":
      return self.attention_impl
    return attention.choose_impl(self.layer_knobs(layer), self.attention_call(seq_len, segments))[platform]

  @property
  def K(self) -> int:
    return (self.qkv_dim or self.D) // self.H


def layer_presets(attention_field: str, L: int) -> tuple[str, ...]:
  """The preset of each of the L layers. `model.attention` names one preset for every layer
  ("hyla"), one per layer ("hyla,hyla,hyla,softmax" with L=4), or a pattern repeated over the layers
  ("hyla,softmax" with L=6: three pairs). A pattern whose length does not divide L is an error, not
  cut short: which layers a cut pattern leaves out is easy to get wrong."""
  names = tuple(name.strip() for name in attention_field.split(","))
  for name in names:
    attention.preset(name)
  if L % len(names):
    raise ValueError(f"model.attention {attention_field!r} is a pattern of {len(names)} layers, which "
                     f"does not divide model.L={L}; name one preset per layer or a pattern whose length "
                     f"divides L")
  return names * (L // len(names))


def _init(stddev: float, *axes: str | None) -> nn.initializers.Initializer:
  """Normal initialiser of a parameter whose dimensions have the logical roles `axes` (lm/sharding.py
  maps roles to mesh axes; a parameter that declares none is an error there)."""
  return nn.with_logical_partitioning(nn.initializers.normal(stddev=stddev), axes)


def _bias(module: nn.Module, name: str, shape: tuple[int, ...], *axes: str | None,
          dtype) -> jax.Array | float:
  """The zero-initialised additive bias `name` when model.projection_bias, else 0."""
  if not module.cfg.projection_bias:
    return 0.0
  return module.param(name, nn.with_logical_partitioning(nn.initializers.zeros, axes), shape).astype(dtype)


def _log_gate(module: nn.Module, x_btd: jax.Array) -> jax.Array:
  """A gated layer's log α [B, T, H, K] in float32, from its input (GATE_RANK, GATE_TEMPERATURE)."""
  cfg, dtype = module.cfg, DTYPES[module.cfg.dtype]
  w1_dr = module.param("gate_w1", _init(cfg.D**-0.5, "embed", None), (cfg.D, GATE_RANK)).astype(dtype)
  w2_rhk = module.param("gate_w2", _init(GATE_RANK**-0.5, None, "heads", None),
                        (GATE_RANK, cfg.H, cfg.K)).astype(dtype)
  b_hk = module.param("gate_b", nn.with_logical_partitioning(nn.initializers.zeros, ("heads", None)),
                      (cfg.H, cfg.K))
  logits_bthk = product(cfg, "btr,rhk->bthk", product(cfg, "btd,dr->btr", x_btd, w1_dr), w2_rhk)
  return jax.nn.log_sigmoid(logits_bthk.astype(jnp.float32) + b_hk) / GATE_TEMPERATURE


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _low_precision_einsum(spec: str, low, x, w):
  return _low_precision_einsum_fwd(spec, low, x, w)[0]


def _low_precision_einsum_fwd(spec, low, x, w):
  x, w = x.astype(low), w.astype(low)
  return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32), (x, w)


def _low_precision_einsum_bwd(spec, low, saved, g):
  # The gradient's products take low-precision operands as well (JAX's own rule would multiply the
  # float32 cotangent by the rounded operand in float32, the slow product this mode avoids).
  x, w = saved
  inputs, out = spec.split("->")
  x_spec, w_spec = inputs.split(",")
  g = g.astype(low)
  dx = jnp.einsum(f"{out},{w_spec}->{x_spec}", g, w, preferred_element_type=jnp.float32)
  dw = jnp.einsum(f"{x_spec},{out}->{w_spec}", x, g, preferred_element_type=jnp.float32)
  return dx, dw


_low_precision_einsum.defvjp(_low_precision_einsum_fwd, _low_precision_einsum_bwd)


def product(cfg: ModelConfig, spec: str, x, w) -> jax.Array:
  """einsum(spec, x, w) in the compute dtype, or with model.matmul_dtype operands and float32 results:
  CPUs with bfloat16 matrix units (AMX) run such products faster than float32 ones, and nothing
  element-wise converts (docs/results/compositional_throughput.md)."""
  if cfg.matmul_dtype in ("", cfg.dtype):
    return jnp.einsum(spec, x, w)
  return _low_precision_einsum(spec, DTYPES[cfg.matmul_dtype], x, w)


def _residual_std(cfg: ModelConfig, fan_in: int) -> float:
  return (fan_in * (2 * cfg.L if cfg.residual_init == "depth" else 1))**-0.5


def _layer_norm(dtype, name: str) -> nn.LayerNorm:
  # Scale and bias are D-vectors, replicated: sharding them would save nothing and cost a gather.
  return nn.LayerNorm(dtype=dtype, name=name,
                      scale_init=nn.with_logical_partitioning(nn.initializers.ones, (None,)),
                      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (None,)))


def rotate_half(x: jax.Array) -> jax.Array:
  """(-x[K/2:], x[:K/2]) along the last axis: each coordinate's partner in the rotary rotation."""
  half = x.shape[-1] // 2
  return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rotary(x_bthk: jax.Array, positions_bt: jax.Array, base: float, partner_bthk=None) -> jax.Array:
  """Rotates pairs (x[i], x[i + K/2]) by angle position / base^(2i/K), in x's dtype.

  partner_bthk: rotate_half(x) if the caller formed it already (model.rope_by_product); then the
  rotation is element-wise. The angles and their sines are float32; the rotation itself runs in x's
  dtype, as MaxText's does: in bfloat16 a float32 rotation made XLA write q, k and their cotangents in
  float32 between the projections and the attention kernel (docs/results/compile_v5e.md)."""
  half = x_bthk.shape[-1] // 2
  freq_k = base**(-jnp.arange(half, dtype=jnp.float32) / half)
  angle_bt1k = positions_bt[:, :, None, None].astype(jnp.float32) * freq_k
  sin, cos = jnp.sin(angle_bt1k).astype(x_bthk.dtype), jnp.cos(angle_bt1k).astype(x_bthk.dtype)
  if partner_bthk is not None:
    return x_bthk * jnp.concatenate([cos, cos], axis=-1) + partner_bthk * jnp.concatenate([sin, sin], axis=-1)
  # Written as halves, not as x cos + rotate_half(x) sin: XLA fuses this form better for HYLA's step.
  x1, x2 = jnp.split(x_bthk, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


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
  log_bucket = max_exact + (jnp.log(jnp.maximum(n, 1) / max_exact) / math.log(max_distance / max_exact) *
                            (num_buckets - max_exact)).astype(jnp.int32)
  log_bucket = jnp.minimum(log_bucket, num_buckets - 1)
  return bucket + jnp.where(n < max_exact, n, log_bucket)


class Attention(nn.Module):
  """Projections around lm.attention.attend with layer `layer`'s preset. Latent codes are computed
  only when the `codes` collection is mutable, which only `latent_codes` (evaluation) makes it.
  decode_len > 0: the inputs are the next tokens after those already in the layer's decoding cache of
  decode_len positions (lm/attention/decode_cache.py), whose exact state depends on the preset.
  query_last > 0: only the last query_last positions ask queries (of every key): the output is
  [B, query_last, D], the rows a full call would give there. Such a call names its query and key
  positions, which not every implementation takes: it runs model.attention_impl if that one can,
  else auto's choice."""
  cfg: ModelConfig
  layer: int
  deterministic: bool = True
  decode_len: int = 0
  query_last: int = 0

  @nn.compact
  def __call__(self, x_btd, positions_bt, segment_ids_bt, bias_bhqk):
    cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
    D, H, K = cfg.D, cfg.H, cfg.K
    init = _init(D**-0.5, "embed", "heads", None)
    w = {n: self.param(n, init, (D, H, K)).astype(dtype) for n in ("wq", "wk", "wv")}
    wo_hkd = self.param("wo", _init(_residual_std(cfg, H * K), "heads", None, "embed"),
                        (H, K, D)).astype(dtype)
    T = x_btd.shape[1]
    q0 = T - self.query_last if self.query_last else 0  # the first position that asks a query
    bq_hk, bk_hk, bv_hk = (_bias(self, n, (H, K), "heads", None, dtype=dtype) for n in ("bq", "bk", "bv"))
    bo_d = _bias(self, "bo", (D,), None, dtype=dtype)
    v_bthk = product(cfg, "btd,dhk->bthk", x_btd, w["wv"]) + bv_hk

    def project(x_btd, w_dhk, b_hk, positions_bt):
      y_bthk = product(cfg, "btd,dhk->bthk", x_btd, w_dhk) + b_hk
      if cfg.positions != "rotary":
        return y_bthk
      if not cfg.rope_by_product:
        return rotary(y_bthk, positions_bt, cfg.rope_base)
      # x rotate_half(w) is rotate_half(x w) exactly: the product permutes and negates columns.
      partner_bthk = product(cfg, "btd,dhk->bthk", x_btd, rotate_half(w_dhk))
      partner_bthk += b_hk if isinstance(b_hk, float) else rotate_half(b_hk)
      return rotary(y_bthk, positions_bt, cfg.rope_base, partner_bthk)

    q_bthk = project(x_btd[:, q0:], w["wq"], bq_hk, positions_bt[:, q0:])
    k_bthk = project(x_btd, w["wk"], bk_hk, positions_bt)
    knobs = cfg.layer_knobs(self.layer)
    log_gate_bthk = _log_gate(self, x_btd) if knobs.gated else None
    positions, impl = None, cfg.attention_impl
    if q0:
      # Explicit (query, key) positions: causality and dropout's pair hashes see the rows' true places.
      positions = (jnp.arange(q0, T), jnp.arange(T))
      bias_bhqk = None if bias_bhqk is None else bias_bhqk[:, :, q0:]
      if impl != "auto" and attention.unsupported(
          impl, knobs,
          attention.Call(T - q0, T, cfg.causal, bias_bhqk is not None, cfg.attention_dropout > 0, True,
                         segment_ids_bt is not None, q_bthk.dtype.name, q_bthk.shape[-1])):
        impl = "auto"
    if self.decode_len:
      if decode_cache.kind(knobs, bias_bhqk is not None) == "recurrent":
        out_bthk = decode_cache.RecurrentState(name="state")(q_bthk, k_bthk, v_bthk, log_gate_bthk)
      else:
        out_bthk = decode_cache.KeyValueCache(self.decode_len, knobs, name="kv")(q_bthk, k_bthk, v_bthk,
                                                                                 positions_bt, bias_bhqk)
      return product(cfg, "bthk,hkd->btd", out_bthk, wo_hkd) + bo_d
    if self.is_mutable_collection("codes"):
      self.sow(
          "codes", "a_bhqk",
          attention.normalized_scores(q_bthk, k_bthk, normalization=knobs.normalization, causal=cfg.causal,
                                      segment_ids=segment_ids_bt, bias=bias_bhqk, positions=positions,
                                      log_gate=log_gate_bthk))
    dropout = 0.0 if self.deterministic else cfg.attention_dropout
    out_bthk = attention.attend(q_bthk, k_bthk, v_bthk, normalization=knobs.normalization,
                                value_network=knobs.value_network, nonlinearity=knobs.nonlinearity,
                                causal=cfg.causal, segment_ids=segment_ids_bt, bias=bias_bhqk, impl=impl,
                                dropout_rate=dropout,
                                dropout_rng=self.make_rng("dropout") if dropout else None,
                                positions=positions, log_gate=log_gate_bthk)
    return product(cfg, "bthk,hkd->btd", out_bthk, wo_hkd) + bo_d


class Mlp(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_btd):
    cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
    wi_df = self.param("wi", _init(cfg.D**-0.5, "embed", "mlp"), (cfg.D, cfg.F)).astype(dtype)
    wo_fd = self.param("wo", _init(_residual_std(cfg, cfg.F), "mlp", "embed"), (cfg.F, cfg.D)).astype(dtype)
    bi_f = _bias(self, "bi", (cfg.F,), "mlp", dtype=dtype)
    bo_d = _bias(self, "bo", (cfg.D,), None, dtype=dtype)
    mlp = lambda x_btd, wi_df, bi_f, wo_fd, bo_d: product(
        cfg, "btf,fd->btd", jax.nn.gelu(product(cfg, "btd,df->btf", x_btd, wi_df) + bi_f), wo_fd) + bo_d
    if cfg.remat == "mlp":
      # The backward pass forms the [B, T, F] hidden again from x rather than writing it to memory and
      # reading it back: a third more MLP FLOPs for two fewer passes over the model's widest activation,
      # a gain where the step is bound by memory traffic (TPU), a loss where it is bound by FLOPs (CPU).
      mlp = jax.checkpoint(mlp)
    return mlp(x_btd, wi_df, bi_f, wo_fd, bo_d)


class Block(nn.Module):
  """query_last > 0: the block's output at the last query_last positions only (see Attention)."""
  cfg: ModelConfig
  layer: int
  deterministic: bool = True
  decode_len: int = 0
  query_last: int = 0

  @nn.compact
  def __call__(self, x_btd, positions_bt, segment_ids_bt, bias_bhqk):
    dtype = DTYPES[self.cfg.dtype]
    y_bqd = Attention(self.cfg, self.layer, self.deterministic, self.decode_len, self.query_last,
                      name="attn")(_layer_norm(dtype, "ln_attn")(x_btd), positions_bt, segment_ids_bt,
                                   bias_bhqk)
    # The residual stream continues at the rows that asked queries (all, or the last query_last).
    x_btd = x_btd[:, x_btd.shape[1] - y_bqd.shape[1]:] + y_bqd
    return x_btd + Mlp(self.cfg, name="mlp")(_layer_norm(dtype, "ln_mlp")(x_btd))


class Transformer(nn.Module):
  """inputs: token ids [B, T] (or float features [B, T, I] when cfg.input_dim > 0) → float32 outputs
  [B, T, V]; with return_readout, the final hidden states and readout weights that form them
  (lm/cross_entropy.py), for a loss that need not write the logits.

  readout_last > 0: outputs at the last readout_last positions only, [B, readout_last, V], for a task
  whose loss and metrics read nothing else (the compositional tasks). They equal the full outputs'
  last rows: the last layer asks queries at those positions only (of every key), and so forms its
  attention, MLP and readout for them alone; earlier layers, whose keys and values it reads, run whole.

  decode_len > 0 (causal models only): incremental decoding. Each call appends its T tokens after
  those of earlier calls, at positions index..index+T-1 of a context of decode_len positions, and
  updates the mutable "cache" collection (every layer's state and `index`); lm/decode.py drives it.
  """
  cfg: ModelConfig
  decode_len: int = 0

  @nn.compact
  def __call__(self, inputs, *, positions_bt=None, segment_ids_bt=None, deterministic: bool = True,
               return_readout: bool = False, readout_last: int = 0):
    cfg, dtype = self.cfg, DTYPES[self.cfg.dtype]
    B, T = inputs.shape[:2]
    explicit_positions = positions_bt is not None
    if readout_last and (explicit_positions or segment_ids_bt is not None or self.decode_len or
                         not 0 < readout_last <= T):
      raise ValueError(f"readout_last={readout_last} needs whole rows (no explicit positions, segment "
                       f"ids or decoding) and 0 < readout_last <= the length {T}")
    if self.decode_len:
      if not cfg.causal or explicit_positions or segment_ids_bt is not None:
        raise ValueError("decoding (decode_len > 0) is for causal models and takes tokens only: "
                         "positions follow the cache's index")
      index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
      positions_bt = jnp.broadcast_to(index.value + jnp.arange(T), (B, T))
      index.value = index.value + T
    elif not explicit_positions:
      positions_bt = jnp.broadcast_to(jnp.arange(T), (B, T))
    if cfg.input_dim:
      w_id = self.param("input_proj", _init(cfg.input_dim**-0.5, None, "embed"), (cfg.input_dim, cfg.D))
      x_btd = inputs.astype(dtype) @ w_id.astype(dtype) + _bias(self, "input_bias",
                                                                (cfg.D,), None, dtype=dtype)
    else:
      embed_vd = self.param("embed", _init(1.0, "vocab", "embed"), (cfg.V, cfg.D))
      x_btd = embed_vd.astype(dtype)[inputs]
    if cfg.positions == "learned":
      pos_embed = self.param("pos_embed", _init(0.02, None, "embed"), (cfg.max_len, cfg.D))
      x_btd = x_btd + pos_embed.astype(dtype)[positions_bt]
    bias_bhqk = None
    if cfg.positions == "relative_bias":
      # Without explicit positions every row has the same bias: build it once, [1, H, T, T], not per
      # row (its gather's gradient is a scatter-add the size of the bias).
      q_pos_bt = positions_bt if explicit_positions else positions_bt[:1]
      # Decoding: the new tokens' queries against every slot of the cache.
      k_pos_bt = jnp.arange(self.decode_len)[None] if self.decode_len else q_pos_bt
      bucket_bqk = relative_bucket(k_pos_bt[:, None, :] - q_pos_bt[:, :, None],
                                   bidirectional=cfg.relative_bidirectional and not cfg.causal,
                                   num_buckets=cfg.relative_buckets, max_distance=cfg.relative_max_distance)
      # A few numbers per head: replicated.
      relative_bias = lambda name: jnp.moveaxis(
          self.param(name, _init(cfg.relative_bias_std, None, None),
                     (cfg.relative_buckets, cfg.H))[bucket_bqk], -1, 1)
      if not cfg.relative_bias_per_layer:
        bias_bhqk = relative_bias("relative_bias")  # one table shared by all layers, as in T5
    # remat saves only for gradients: decoding has none.
    block = nn.remat(Block) if cfg.remat == "block" and not self.decode_len else Block
    x_btd = sharding.constrain_batch(x_btd)
    for i in range(cfg.L):
      if cfg.positions == "relative_bias" and cfg.relative_bias_per_layer:
        bias_bhqk = relative_bias(f"relative_bias_{i}")
      query_last = readout_last if i == cfg.L - 1 else 0
      x_btd = block(cfg, i, deterministic, self.decode_len, query_last,
                    name=f"block_{i}")(x_btd, positions_bt, segment_ids_bt, bias_bhqk)
      x_btd = sharding.constrain_batch(x_btd)
    x_btd = _layer_norm(dtype, "ln_final")(x_btd)
    if cfg.tied_embeddings and not cfg.input_dim:
      readout = cross_entropy.Readout(x_btd, embed_vd.astype(dtype).T, cfg.D**-0.5)
    else:
      unembed_dv = self.param("unembed", _init(cfg.D**-0.5, "embed", "vocab"), (cfg.D, cfg.V))
      readout = cross_entropy.Readout(x_btd, unembed_dv.astype(dtype), 1.0)
    return readout if return_readout else readout.logits().astype(jnp.float32)


def latent_codes(model: Transformer, params, inputs, **kw) -> list[jax.Array]:
  """Evaluation only: each layer's latent codes, the normalised scores a_bhqk [B, H, T, T] in float32
  (masked pairs exactly 0; dropout never applies). kw: Transformer's keyword arguments."""
  _, state = model.apply({"params": params}, inputs, mutable="codes", **kw)
  return [state["codes"][f"block_{i}"]["attn"]["a_bhqk"][0] for i in range(model.cfg.L)]


def count_params(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))
