"""Gated linear attention (the `gla` preset): its recurrence against the core's definition, the
chunked training form against the recurrence (values and gradients, causality, packed documents),
the gate's parameters and FLOPs, and the settings it refuses. Its decoding state is tested with every
other preset's in tests/test_sample.py."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm import attention, decode, flops, model as model_lib, sharding
from lm.attention import gated

GLA = dict(normalization="none", value_network="linear")
T = 21
# A reset inside a chunk of 4 and one across chunks; 0 at the end is padding, as packing makes.
SEGMENTS_BT = jnp.array([[1] * 5 + [2] * 12 + [3] * 4, [1] * 16 + [0] * 5])


def _inputs(B=2, T=T, H=3, K=4, seed=0, gate_scale=2.0):
  ks = jax.random.split(jax.random.key(seed), 5)
  q, k, v = (jax.random.normal(x, (B, T, H, K)) for x in ks[:3])
  log_gate = jax.nn.log_sigmoid(gate_scale * jax.random.normal(ks[3], (B, T, H, K)))
  return (q, k, v, log_gate), jax.random.normal(ks[4], (B, T, H, K))


def _out_and_grads(f, args, cotangent):
  out, pull = jax.vjp(f, *args)
  return out, pull(cotangent)


def _assert_same(f, g, args, cotangent, rtol=2e-5):
  (out_f,
   grads_f), (out_g,
              grads_g) = (jax.jit(_out_and_grads, static_argnums=0)(h, args, cotangent) for h in (f, g))
  np.testing.assert_allclose(out_f, out_g, rtol=rtol, atol=rtol * np.abs(out_g).max())
  for name, a, b in zip(("dq", "dk", "dv", "dlog_gate"), grads_f, grads_g):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max(), err_msg=name)


def _loop(q, k, v, log_gate, segment_ids):
  """The recurrence in numpy, token by token: S_t = diag(α_t) S_{t-1} + k_tᵀ v_t, o_t = q_t S_t / √d."""
  q, k, v, alpha = (np.asarray(x, np.float64) for x in (q, k, v, jnp.exp(log_gate)))
  B, T, H, K = q.shape
  out = np.zeros_like(q)
  for b in range(B):
    s_hde = np.zeros((H, K, K))
    for t in range(T):
      if t and segment_ids[b, t] != segment_ids[b, t - 1]:
        s_hde[:] = 0
      s_hde = alpha[b, t][:, :, None] * s_hde + k[b, t][:, :, None] * v[b, t][:, None, :]
      out[b, t] = np.einsum("hd,hde->he", q[b, t], s_hde) / np.sqrt(K)
  return out


@pytest.mark.parametrize("segments", [False, True])
def test_recurrence_is_the_definition(segments):
  """The scan is the recurrence written out (numpy), and it equals the core's quadratic definition
  (impl="reference"): values and gradients."""
  args, cotangent = _inputs()
  seg = SEGMENTS_BT if segments else None
  out = attention.attend(*args[:3], **GLA, log_gate=args[3], segment_ids=seg, impl="gla_recurrent")
  np.testing.assert_allclose(out, _loop(*args, np.asarray(SEGMENTS_BT if segments else jnp.zeros((2, T)))),
                             rtol=1e-5, atol=1e-5)
  attend = lambda impl: lambda q, k, v, g: attention.attend(q, k, v, **GLA, log_gate=g, segment_ids=seg, impl=
                                                            impl)
  _assert_same(attend("gla_recurrent"), attend("reference"), args, cotangent)


@pytest.mark.parametrize("chunk", [4, 16, 64])
def test_chunked_equals_the_recurrence(chunk):
  """Values and gradients, with resets inside and across chunks, whole and padded last chunks."""
  args, cotangent = _inputs()
  chunked = lambda q, k, v, g: gated.attend_chunked(q, k, v, log_gate=g, segment_ids=SEGMENTS_BT, chunk=chunk)
  recurrent = lambda q, k, v, g: gated.attend_recurrent(q, k, v, log_gate=g, segment_ids=SEGMENTS_BT)
  _assert_same(chunked, recurrent, args, cotangent)


def test_chunked_is_finite_where_the_gate_forgets_almost_everything():
  """log α down to about -60 per step: a chunk's decay spans e^-1000, which a factored q e^g, k e^-g
  form would overflow; every exponent the chunks take is ≤ 0."""
  args, cotangent = _inputs(gate_scale=60.0)
  chunked = lambda q, k, v, g: gated.attend_chunked(q, k, v, log_gate=g, chunk=16)
  recurrent = lambda q, k, v, g: gated.attend_recurrent(q, k, v, log_gate=g)
  out, grads = jax.jit(_out_and_grads, static_argnums=0)(chunked, args, cotangent)
  assert all(np.isfinite(x).all() for x in (out, *grads))
  _assert_same(chunked, recurrent, args, cotangent, rtol=1e-4)


def test_chunked_is_causal_and_documents_do_not_see_each_other():
  (q, k, v, g), _ = _inputs()
  run = lambda q, k, v, g, seg=None: gated.attend_chunked(q, k, v, log_gate=g, segment_ids=seg, chunk=4)
  t = 9
  later = lambda x: x.at[:, t + 1:].set(x[:, t + 1:] * 3 + 1)
  np.testing.assert_allclose(
      run(q, k, v, g)[:, :t + 1],
      run(later(q), later(k), later(v), g)[:, :t + 1], rtol=1e-6, atol=1e-6)
  # The second document of a packed row gives what it gives alone at the start of a row.
  seg = jnp.array([[1] * 5 + [2] * 16] * 2)
  alone = run(*(x[:, 5:] for x in (q, k, v, g)))
  np.testing.assert_allclose(run(q, k, v, g, seg)[:, 5:], alone, rtol=1e-5, atol=1e-5)


def test_no_gate_is_linear_attention():
  (q, k, v, _), _ = _inputs()
  np.testing.assert_allclose(gated.attend_chunked(q, k, v, segment_ids=SEGMENTS_BT, chunk=4),
                             attention.attend(q, k, v, **GLA, segment_ids=SEGMENTS_BT, impl="chunked"),
                             rtol=1e-5, atol=1e-5)


def test_the_table_routes_gated_calls_to_the_gated_rows():
  knobs = attention.Knobs(**attention.preset("gla"))
  chosen = attention.choose_impl(knobs, attention.Call(4096, 4096, True, False, False))
  assert chosen == {"cpu": "gla_chunked", "tpu": "gla_chunked", "gpu": "gla_chunked"}
  # Ungated linear attention keeps its own kernels.
  assert attention.choose_impl(attention.Knobs(**attention.preset("linear")),
                               attention.Call(4096, 4096, True, False, False))["cpu"] == "chunked"
  assert [n for n, impl in attention.IMPLS.items() if impl.gate
         ] == ["gla_chunked", "gla_recurrent", "reference"]
  with pytest.raises(ValueError,
                     match="attention impl 'chunked' takes no gate; use impl 'auto', 'gla_chunked'"):
    attention.check("chunked", knobs, attention.Call(64, 64, True, False, False))
  (q, k, v, g), _ = _inputs()
  with pytest.raises(ValueError, match="log_gate must be shaped like k"):
    attention.attend(q, k, v, **GLA, log_gate=g[:, :3])


@pytest.mark.parametrize(
    "bad",
    [dict(causal=False), dict(positions="relative_bias"),
     dict(attention_dropout=0.1)])
def test_gla_is_causal_and_takes_no_position_bias_or_dropout(bad):
  with pytest.raises(ValueError,
                     match="gated attention is causal and takes no position bias or attention dropout"):
    model_lib.ModelConfig(V=8, D=16, H=2, attention="gla", **bad)


def _gla_model(**kw):
  cfg = model_lib.ModelConfig(**{"V": 50, "D": 32, "H": 4, "L": 2, "F": 64, "attention": "gla", **kw})
  return cfg, model_lib.Transformer(cfg)


def test_the_model_gate_is_sharded_like_the_projections_and_counted_in_flops():
  cfg, m = _gla_model()
  boxed = jax.eval_shape(m.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  attn = boxed["block_0"]["attn"]
  roles = {n: attn[n].names for n in ("gate_w1", "gate_w2", "gate_b", "wq")}
  assert roles == {
      "gate_w1": ("embed", None),
      "gate_w2": (None, "heads", None),
      "gate_b": ("heads", None),
      "wq": ("embed", "heads", None)
  }
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), sharding.AXES)
  sharding.shardings(nn.meta.unbox(boxed), mesh, params=boxed)  # raises on an undeclared parameter
  # GLA's core: linear attention's per pair plus the decay's multiply per dimension.
  linear_cfg = model_lib.ModelConfig(**{**cfg.__dict__, "attention": "linear"})
  n = model_lib.count_params(nn.meta.unbox(boxed))
  gap = flops.flops_per_token(cfg, n, 64) - flops.flops_per_token(linear_cfg, n, 64)
  assert gap == 3 * 64 * cfg.L * cfg.D


def test_the_model_runs_the_chunks_and_they_equal_its_definition():
  """A GLA model's logits and gradients with auto (the chunks) and with the reference."""
  cfg, m = _gla_model()
  tokens_bt = jax.random.randint(jax.random.key(1), (2, 20), 0, 50)
  params = jax.jit(m.init)(jax.random.key(2), tokens_bt)["params"]
  ref = model_lib.Transformer(model_lib.ModelConfig(**{**cfg.__dict__, "attention_impl": "reference"}))
  loss = lambda model: jax.jit(jax.value_and_grad(lambda p: jnp.sum(model.apply({"params": p}, tokens_bt)**2))
                              )
  (a, grads_a), (b, grads_b) = loss(m)(params), loss(ref)(params)
  np.testing.assert_allclose(a, b, rtol=1e-5)
  for x, y in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4 * np.abs(y).max())


def test_the_decoding_state_is_constant_size():
  """GLA decodes with linear attention's [B, H, K, K] state, whatever the number of tokens; the same
  tokens give the full forward pass's logits (tests/test_sample.py checks every position)."""
  cfg, m = _gla_model(L=1)
  tokens_bt = jax.random.randint(jax.random.key(1), (1, 30), 0, 50)
  params = jax.jit(m.init)(jax.random.key(2), tokens_bt)["params"]
  decoder = decode.Decoder(cfg, 30)
  apply = jax.jit(decoder.apply)
  cache = decoder.init_cache(params, 1)
  shapes = []
  for t in range(30):
    logits, cache = apply(params, cache, tokens_bt[:, t:t + 1])
    shapes.append(jax.tree.map(jnp.shape, cache["block_0"]))
  assert shapes[4] == shapes[29] == {"attn": {"state": {"s_bhkk": (1, cfg.H, cfg.K, cfg.K)}}}
  full = m.apply({"params": params}, tokens_bt)
  np.testing.assert_allclose(logits[:, 0], full[:, -1], rtol=1e-5, atol=1e-5 * np.abs(full).max())
