"""The attention core shared by every variant (DESIGN.md, "one core, two knobs").

q, k, v: [batch, seq, heads, head_dim] → out like q, in three steps:
  1. scores  s_bhqk = q·k / sqrt(d) + bias, masked by causality and packed-document segments;
  2. normalisation σ: softmax over keys, none, or rms_head (RMS over the head axis per (q, k));
  3. value network: linear, out_bqhd = Σ_k a_bhqk v_bkhd; or hypernetwork,
     z_bkqd = Σ_h a_bhqk v_bkhd, out_bqhd = Σ_k a_bhqk φ(z_bkqd).

`impl="reference"` is the literal einsum definition and the ground truth faster kernels are tested against.
The others compute the same function without the [b, h, t, t] / [b, t, t, d] tensors (see `IMPLS`);
`impl="auto"` picks the fastest one that applies to the knobs, shapes and platform.
"""

from typing import Callable

import jax
import jax.numpy as jnp

from lm import attention_blocked, attention_linear, attention_softmax

NORMALIZATIONS = ("softmax", "none", "rms_head")
VALUE_NETWORKS = ("linear", "hypernetwork")
NONLINEARITIES: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "silu": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "identity": lambda x: x,
}
# auto: chosen per call by `choose_impl`; reference: the einsum definition; blocked: tiled, every knob
# setting (lm/attention_blocked.py); chunked: causal linear attention in O(t·d²) (lm/attention_linear.py);
# dot_product: jax.nn.dot_product_attention, softmax only (XLA, or cuDNN on GPU); pallas: the TPU flash
# attention kernel, softmax only (lm/attention_softmax.py).
IMPLS = ("auto", "reference", "blocked", "chunked", "dot_product", "pallas")
RMS_HEAD_EPS = 1e-6

# Paper section 2: the three main variants and the ablations, each a full setting of the knobs.
PRESETS: dict[str, dict[str, str]] = {
    "softmax": dict(normalization="softmax", value_network="linear"),
    "linear": dict(normalization="none", value_network="linear"),
    "hyla": dict(normalization="rms_head", value_network="hypernetwork", nonlinearity="relu"),
    "linear_rms_head": dict(normalization="rms_head", value_network="linear"),
    "hyla_no_rms_head": dict(normalization="none", value_network="hypernetwork", nonlinearity="relu"),
    "hyla_no_nonlinearity": dict(
        normalization="rms_head", value_network="hypernetwork", nonlinearity="identity"),
    "hyla_softmax": dict(normalization="softmax", value_network="hypernetwork", nonlinearity="relu"),
    **{f"hyla_{phi}": dict(normalization="rms_head", value_network="hypernetwork", nonlinearity=phi)
       for phi in ("gelu", "silu", "sigmoid", "tanh")},
}


def preset(name: str) -> dict[str, str]:
  """The knob settings of a named variant; unknown names fail listing the valid ones."""
  if name not in PRESETS:
    raise ValueError(f"unknown attention {name!r}; choose one of: {', '.join(PRESETS)}")
  return {"nonlinearity": "relu", **PRESETS[name]}


def check_knobs(normalization: str, value_network: str, nonlinearity: str, impl: str) -> None:
  for what, value, valid in (("normalization", normalization, NORMALIZATIONS),
                             ("value_network", value_network, VALUE_NETWORKS),
                             ("nonlinearity", nonlinearity, tuple(NONLINEARITIES)),
                             ("impl", impl, IMPLS)):
    if value not in valid:
      raise ValueError(f"unknown attention {what} {value!r}; choose one of: {', '.join(valid)}")
  if impl == "chunked" and (normalization, value_network) != ("none", "linear"):
    raise ValueError(f"attention impl 'chunked' computes linear attention only (normalization none, "
                     f"value_network linear), not {normalization}/{value_network}; use impl 'auto' or "
                     f"'blocked'")
  if impl in ("dot_product", "pallas") and (normalization, value_network) != ("softmax", "linear"):
    raise ValueError(f"attention impl {impl!r} computes softmax attention only, not "
                     f"{normalization}/{value_network}; use impl 'auto' or 'blocked'")


def pair_mask(q_pos_q: jax.Array, k_pos_k: jax.Array, *, causal: bool,
              q_segment_ids_bq: jax.Array | None = None,
              k_segment_ids_bk: jax.Array | None = None) -> jax.Array | None:
  """Boolean [batch or 1, 1, q, k] mask of allowed pairs among the given positions, or None when
  everything is allowed."""
  mask = None
  if causal:
    mask = (q_pos_q[:, None] >= k_pos_k[None, :])[None, None]
  if q_segment_ids_bq is not None:
    same_bqk = q_segment_ids_bq[:, :, None] == k_segment_ids_bk[:, None, :]
    mask = same_bqk[:, None] if mask is None else mask & same_bqk[:, None]
  return mask


def attention_mask(q_len: int, k_len: int, *, causal: bool,
                   segment_ids: jax.Array | None) -> jax.Array | None:
  """Boolean [batch or 1, 1, q, k] mask of allowed pairs, or None when everything is allowed."""
  return pair_mask(jnp.arange(q_len), jnp.arange(k_len), causal=causal, q_segment_ids_bq=segment_ids,
                   k_segment_ids_bk=segment_ids)


def masked_scores(q_bqhd: jax.Array, k_bkhd: jax.Array, bias: jax.Array | None,
                  mask: jax.Array | None) -> jax.Array:
  """Step 1: s_bhqk = q·k / sqrt(d) + bias in float32, masked entries 0."""
  scale = q_bqhd.shape[-1] ** -0.5
  s_bhqk = jnp.einsum("bqhd,bkhd->bhqk", q_bqhd, k_bkhd, preferred_element_type=jnp.float32) * scale
  if bias is not None:
    s_bhqk = s_bhqk + bias.astype(jnp.float32)
  if mask is not None:
    # Zeroing before σ is what keeps masked entries out of the RMS over heads as well.
    s_bhqk = jnp.where(mask, s_bhqk, 0.0)
  return s_bhqk


def rms_head(s_bhqk: jax.Array) -> tuple[jax.Array, jax.Array]:
  """s divided by its root mean square over the heads of its (q, k) pair, and the reciprocal RMS
  r_b1qk (the blocked kernel's pullback reuses it)."""
  r_b1qk = jax.lax.rsqrt(jnp.mean(jnp.square(s_bhqk), axis=1, keepdims=True) + RMS_HEAD_EPS)
  return s_bhqk * r_b1qk, r_b1qk


def normalize(s_bhqk: jax.Array, mask: jax.Array | None, *, normalization: str,
              lse_bhq: jax.Array | None = None) -> jax.Array:
  """Step 2 on masked scores. Softmax over a slice of the keys takes the full row's log-sum-exp
  `lse_bhq` (as the blocked kernel does); without it, the softmax is over the keys given."""
  if normalization == "softmax":
    if lse_bhq is not None:
      # -inf (not a large negative) where masked: exp gives exactly 0 and a zero gradient.
      s_bhqk = s_bhqk - lse_bhq[..., None]
      return jnp.exp(s_bhqk if mask is None else jnp.where(mask, s_bhqk, -jnp.inf))
    if mask is not None:
      s_bhqk = jnp.where(mask, s_bhqk, jnp.finfo(jnp.float32).min)
    a_bhqk = jax.nn.softmax(s_bhqk, axis=-1)
  elif normalization == "none":
    a_bhqk = s_bhqk
  elif normalization == "rms_head":
    a_bhqk = rms_head(s_bhqk)[0]
  else:
    raise ValueError(f"unknown attention normalization {normalization!r}; "
                     f"choose one of: {', '.join(NORMALIZATIONS)}")
  if mask is not None:
    a_bhqk = jnp.where(mask, a_bhqk, 0.0)
  return a_bhqk


def normalized_scores(q_bqhd: jax.Array, k_bkhd: jax.Array, *, normalization: str,
                      causal: bool = True, segment_ids: jax.Array | None = None,
                      bias: jax.Array | None = None) -> jax.Array:
  """Steps 1-2: the normalised scores a_bhqk in float32. For a (q, k) pair, a[:, :, q, k] across
  heads is the pair's latent code; masked entries are exactly 0 in every normalisation."""
  mask = attention_mask(q_bqhd.shape[1], k_bkhd.shape[1], causal=causal, segment_ids=segment_ids)
  return normalize(masked_scores(q_bqhd, k_bkhd, bias, mask), mask, normalization=normalization)


def apply_value_network(a_bhqk: jax.Array, v_bkhd: jax.Array, *, value_network: str,
                        nonlinearity: str = "relu") -> jax.Array:
  """Step 3, on given scores: [batch, heads, q, k] × [batch, k, heads, d] → [batch, q, heads, d]."""
  a_bhqk = a_bhqk.astype(v_bkhd.dtype)
  if value_network == "linear":
    return jnp.einsum("bhqk,bkhd->bqhd", a_bhqk, v_bkhd)
  if value_network == "hypernetwork":
    # z is the generated first layer applied to x_k: one d-vector per (query, key) pair. Key-major,
    # as the contraction over heads is a matmul batched over keys: z is never transposed.
    z_bkqd = jnp.einsum("bhqk,bkhd->bkqd", a_bhqk, v_bkhd)
    return jnp.einsum("bhqk,bkqd->bqhd", a_bhqk, NONLINEARITIES[nonlinearity](z_bkqd))
  raise ValueError(f"unknown attention value_network {value_network!r}; "
                   f"choose one of: {', '.join(VALUE_NETWORKS)}")


def choose_impl(normalization: str, value_network: str, *, causal: bool,
                bias: jax.Array | None) -> str:
  """The fastest implementation of these knobs, memory linear in sequence length wherever one exists.
  Softmax attention stays 'auto': lm/attention_softmax.py picks its kernel per platform at lowering.
  Causal linear attention without a bias goes to the chunked form, all else (HYLA, the ablations) to the
  blocked kernel."""
  if (normalization, value_network) == ("softmax", "linear"):
    return "auto"  # attend_softmax picks its kernel per platform when lowering
  if (normalization, value_network) == ("none", "linear") and causal and bias is None:
    return "chunked"
  return "blocked"


def attend(q: jax.Array, k: jax.Array, v: jax.Array, *, normalization: str, value_network: str,
           nonlinearity: str = "relu", causal: bool = True, segment_ids: jax.Array | None = None,
           bias: jax.Array | None = None, impl: str = "reference") -> jax.Array:
  """Maps q, k, v [batch, seq, heads, head_dim] to [batch, seq, heads, head_dim].

  segment_ids [batch, seq]: tokens attend only within their own segment (packed documents).
  bias: additive, broadcastable to [batch, heads, q, k] (e.g. relative position bias).
  """
  check_knobs(normalization, value_network, nonlinearity, impl)
  if impl == "auto":
    impl = choose_impl(normalization, value_network, causal=causal, bias=bias)
  knobs = dict(normalization=normalization, value_network=value_network, nonlinearity=nonlinearity)
  if impl == "blocked":
    return attention_blocked.attend_blocked(q, k, v, **knobs, causal=causal, segment_ids=segment_ids,
                                            bias=bias)
  if impl == "chunked":
    return attention_linear.attend_chunked(q, k, v, causal=causal, segment_ids=segment_ids, bias=bias)
  if impl in ("auto", "dot_product", "pallas"):
    return attention_softmax.attend_softmax(q, k, v, causal=causal, segment_ids=segment_ids, bias=bias,
                                            impl=impl)
  a_bhqk = normalized_scores(q, k, normalization=normalization, causal=causal,
                             segment_ids=segment_ids, bias=bias)
  return apply_value_network(a_bhqk, v, value_network=value_network,
                             nonlinearity=nonlinearity).astype(q.dtype)
