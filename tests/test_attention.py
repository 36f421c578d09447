"""The attention core's math, pinned against explicit constructions in numpy."""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm import attention, model as model_lib
from lm.attention import core as attention_core

jax.config.update("jax_enable_x64", False)
COMBOS = list(itertools.product(attention.NORMALIZATIONS, attention.VALUE_NETWORKS))


def _np_scores(q_bqhd, k_bkhd, normalization, mask_qk):
  """Independent numpy version of steps 1-2 for one batch element: a[h, q, k]."""
  s_hqk = np.einsum("qhd,khd->hqk", q_bqhd, k_bkhd) / np.sqrt(q_bqhd.shape[-1])
  s_hqk = np.where(mask_qk, s_hqk, 0.0)
  if normalization == "softmax":
    e = np.where(mask_qk, np.exp(s_hqk - s_hqk.max(-1, keepdims=True)), 0.0)
    return e / e.sum(-1, keepdims=True)
  if normalization == "rms_head":
    return s_hqk / np.sqrt((s_hqk**2).mean(0, keepdims=True) + 1e-6)
  return s_hqk


def _layer(normalization, value_network, nonlinearity="relu", D=12, H=3, T=6, seed=0):
  """An attention layer without positions, its float64 parameters and an input."""
  name = next(n for n, k in attention.PRESETS.items() if k["normalization"] == normalization and
              k["value_network"] == value_network and k.get("nonlinearity", "relu") == nonlinearity)
  cfg = model_lib.ModelConfig(V=8, D=D, H=H, L=1, F=8, attention=name, positions="none")
  layer = model_lib.Attention(cfg, 0)
  x_btd = jax.random.normal(jax.random.key(seed), (1, T, D))
  args = (x_btd, jnp.zeros((1, T), jnp.int32), None, None)
  params = nn.meta.unbox(layer.init(jax.random.key(seed + 1), *args)["params"])
  y_btd = layer.apply({"params": params}, *args)
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  return p, np.asarray(x_btd[0], np.float64), np.asarray(y_btd[0], np.float64)


@pytest.mark.slow
@pytest.mark.parametrize("normalization", ["softmax", "none"])
def test_linear_value_network_is_a_hypernetwork(normalization):
  """y_q = Σ_k W_qk x_k with W_qk = Σ_h a[h,q,k] W_out_h W_val_h built explicitly."""
  p, x_td, y_td = _layer(normalization, "linear")
  T = x_td.shape[0]
  q, k = np.einsum("td,dhk->thk", x_td, p["wq"]), np.einsum("td,dhk->thk", x_td, p["wk"])
  a_hqk = _np_scores(q, k, normalization, np.tril(np.ones((T, T), bool)))
  for qi in range(T):
    y = np.zeros(x_td.shape[1])
    for ki in range(T):
      w_dd = sum(a_hqk[h, qi, ki] * p["wv"][:, h, :] @ p["wo"][h] for h in range(a_hqk.shape[0]))
      y += x_td[ki] @ w_dd
    np.testing.assert_allclose(y_td[qi], y, rtol=2e-4, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("nonlinearity", ["relu", "tanh", "identity"])
def test_hyla_is_a_generated_two_layer_network(nonlinearity):
  """y_q = Σ_k W_out_qk φ(W_val_qk x_k), W_val_qk = Σ_h a W_val_h, W_out_qk = Σ_h a W_out_h."""
  phi = {"relu": lambda z: np.maximum(z, 0), "tanh": np.tanh, "identity": lambda z: z}[nonlinearity]
  p, x_td, y_td = _layer("rms_head", "hypernetwork", nonlinearity)
  T, H = x_td.shape[0], p["wq"].shape[1]
  q, k = np.einsum("td,dhk->thk", x_td, p["wq"]), np.einsum("td,dhk->thk", x_td, p["wk"])
  a_hqk = _np_scores(q, k, "rms_head", np.tril(np.ones((T, T), bool)))
  for qi in range(T):
    y = np.zeros(x_td.shape[1])
    for ki in range(T):
      w_val_dk = sum(a_hqk[h, qi, ki] * p["wv"][:, h, :] for h in range(H))
      w_out_kd = sum(a_hqk[h, qi, ki] * p["wo"][h] for h in range(H))
      y += phi(x_td[ki] @ w_val_dk) @ w_out_kd
    np.testing.assert_allclose(y_td[qi], y, rtol=2e-4, atol=2e-5)


def _qkv(B=2, T=10, H=3, K=4, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return [jax.random.normal(k, (B, T, H, K)) for k in ks]


@pytest.mark.slow
@pytest.mark.parametrize("normalization,value_network", COMBOS)
def test_causality(normalization, value_network):
  q, k, v = _qkv()
  out = attention.attend(q, k, v, normalization=normalization, value_network=value_network)
  t = 4
  q2, k2, v2 = (x.at[:, t + 1:].set(7.0) for x in (q, k, v))
  out2 = attention.attend(q2, k2, v2, normalization=normalization, value_network=value_network)
  np.testing.assert_allclose(out[:, :t + 1], out2[:, :t + 1], rtol=1e-6, atol=1e-6)
  assert not np.allclose(out[:, t + 1:], out2[:, t + 1:])


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("normalization,value_network", COMBOS)
def test_segments_are_isolated(normalization, value_network, causal):
  q, k, v = _qkv()
  seg_bt = jnp.array([[1] * 4 + [2] * 6, [1] * 7 + [0] * 3])
  kw = dict(normalization=normalization, value_network=value_network, causal=causal, segment_ids=seg_bt)
  out = attention.attend(q, k, v, **kw)
  changed = seg_bt != 1  # rewrite everything outside segment 1
  q2, k2, v2 = (jnp.where(changed[..., None, None], 3.0, x) for x in (q, k, v))
  out2 = attention.attend(q2, k2, v2, **kw)
  np.testing.assert_allclose(np.where(changed[..., None, None], 0, out),
                             np.where(changed[..., None, None], 0, out2), rtol=1e-6, atol=1e-6)
  # Bidirectional attention inside a segment does see later tokens of the same segment.
  q3 = q.at[0, 3].add(1.0)
  out3 = attention.attend(q3, k.at[0, 3].add(1.0), v.at[0, 3].add(1.0), **kw)
  assert np.allclose(out3[0, :3], out[0, :3]) == causal


def test_rms_head_zeros_masked_and_unit_rms_elsewhere():
  q, k, _ = _qkv(H=8)
  seg_bt = jnp.array([[1] * 5 + [2] * 5, [1] * 10])
  a_bhqk = attention.normalized_scores(q, k, normalization="rms_head", segment_ids=seg_bt)
  mask_bqk = np.asarray(attention_core.attention_mask(10, 10, causal=True, segment_ids=seg_bt))[:, 0]
  assert np.all(np.asarray(a_bhqk).transpose(1, 0, 2, 3)[:, ~mask_bqk] == 0.0)
  rms_bqk = np.sqrt(np.mean(np.square(a_bhqk), axis=1))
  np.testing.assert_allclose(rms_bqk[mask_bqk], 1.0, atol=1e-3)


@pytest.mark.slow
def test_softmax_matches_jax_dot_product_attention():
  q, k, v = _qkv(T=12)
  ours = attention.attend(q, k, v, normalization="softmax", value_network="linear")
  theirs = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_none_normalisation_is_raw_scaled_scores():
  q, k, v = _qkv(B=1)
  a = attention.normalized_scores(q, k, normalization="none", causal=False)
  np.testing.assert_allclose(a, jnp.einsum("bqhd,bkhd->bhqk", q, k) / 2.0, rtol=1e-6)


@pytest.mark.slow
def test_bias_is_added_before_normalisation():
  q, k, v = _qkv(B=1, H=2)
  bias = jnp.zeros((1, 2, 10, 10)).at[:, :, :, 0].set(50.0)
  a = attention.normalized_scores(q, k, normalization="softmax", bias=bias)
  np.testing.assert_allclose(a[..., 0], 1.0, atol=1e-6)  # the bias dominates every query's row


@pytest.mark.slow
@pytest.mark.parametrize("bias_shape", [(1, 2, 10, 10), (3, 2, 10, 10), (2, 10, 10), (1, 1, 10, 10),
                                        (3, 1, 10, 10)])
def test_a_broadcast_bias_gets_the_gradient_of_the_plain_sum(bias_shape):
  # The bias's gradient is summed over the batch by a product with ones (a faster form on CPU): it must
  # equal what differentiating the plain broadcast sum gives, for every shape a bias may have.
  q, k, _ = _qkv(B=3, H=2)
  bias = jax.random.normal(jax.random.key(7), bias_shape)
  w_bhqk = jax.random.normal(jax.random.key(8), (3, 2, 10, 10))
  ours = lambda b: jnp.sum(attention_core.masked_scores(q, k, b, None)**2 * w_bhqk)
  plain = lambda b: jnp.sum((attention_core.masked_scores(q, k, None, None) + b)**2 * w_bhqk)
  np.testing.assert_allclose(ours(bias), plain(bias), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(ours)(bias), jax.grad(plain)(bias), rtol=1e-5, atol=1e-5)
  q_grads = [
      jax.grad(lambda q, f=f: jnp.sum(f(q)**2))(q)
      for f in (lambda q: attention_core.masked_scores(q, k, bias, None),
                lambda q: attention_core.masked_scores(q, k, None, None) + bias)
  ]
  np.testing.assert_allclose(*q_grads, rtol=1e-5, atol=1e-5)


def test_presets_cover_the_paper_ablations():
  knobs = {n: attention.preset(n) for n in attention.PRESETS}
  assert knobs["softmax"] == dict(normalization="softmax", value_network="linear", nonlinearity="relu")
  assert knobs["linear"]["normalization"] == "none" and knobs["linear"]["value_network"] == "linear"
  assert knobs["hyla"] == dict(normalization="rms_head", value_network="hypernetwork", nonlinearity="relu")
  settings = {(k["normalization"], k["value_network"],
               k["nonlinearity"] if k["value_network"] == "hypernetwork" else None, k.get("gated", False))
              for k in knobs.values()}
  assert len(settings) == len(knobs), "two presets with the same math"
  for phi in ("gelu", "silu", "sigmoid", "tanh", "identity", "relu"):
    assert ("rms_head", "hypernetwork", phi, False) in settings
  for norm in attention.NORMALIZATIONS:
    assert (norm, "hypernetwork", "relu", False) in settings and (norm, "linear", None, False) in settings


@pytest.mark.parametrize("bad,message", [
    (dict(attention="hyla2"), "unknown attention 'hyla2'; choose one of: softmax, linear, hyla"),
    (dict(D=10, H=4), "not divisible by 4 heads"),
    (dict(positions="alibi"), "unknown model.positions 'alibi'"),
])
def test_bad_model_config_fails_with_a_clear_message(bad, message):
  with pytest.raises(ValueError, match=message):
    model_lib.ModelConfig(V=8, **{"D": 16, "H": 4, **bad})


def test_unknown_nonlinearity_fails():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="unknown attention nonlinearity 'swish'; choose one of: relu"):
    attention.attend(q, k, v, normalization="rms_head", value_network="hypernetwork", nonlinearity="swish")
