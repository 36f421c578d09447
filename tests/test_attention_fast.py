"""The fast attention implementations against impl="reference": values, gradients, memory, kernels."""

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core

from lm import attention, attention_blocked, model as model_lib

COMBOS = list(itertools.product(attention.NORMALIZATIONS, attention.VALUE_NETWORKS))
# 21 tokens: two full blocks of 8 and a padded third; segment 0 at the end is padding, as packing makes.
T = 21
SEGMENTS_BT = jnp.array([[1] * 5 + [2] * 12 + [3] * 4, [1] * 16 + [0] * 5])


def _inputs(B=2, T=T, H=3, K=4, seed=0):
  ks = jax.random.split(jax.random.key(seed), 5)
  q, k, v = (jax.random.normal(x, (B, T, H, K)) for x in ks[:3])
  bias_1hqk = jax.random.normal(ks[3], (1, H, T, T))
  cotangent = jax.random.normal(ks[4], (B, T, H, K))
  return q, k, v, bias_1hqk, cotangent


def _assert_same(impl_fn, knobs, *, segment_ids, bias, causal=True, rtol=2e-4):
  """impl_fn(q, k, v, bias, **kw) equals the reference in its output and in its pullback of a random
  cotangent with respect to q, k, v (and the bias)."""
  q, k, v, bias_1hqk, cotangent = _inputs()
  kw = dict(**knobs, causal=causal, segment_ids=segment_ids)
  bias = bias_1hqk if bias else None
  reference = lambda q, k, v, b: attention.attend(q, k, v, **kw, bias=b)
  fast = lambda q, k, v, b: impl_fn(q, k, v, **kw, bias=b)
  out_ref, pull_ref = jax.vjp(reference, q, k, v, bias)
  out, pull = jax.vjp(fast, q, k, v, bias)
  np.testing.assert_allclose(out, out_ref, rtol=rtol, atol=rtol * np.abs(out_ref).max())
  for name, g, g_ref in zip(("dq", "dk", "dv", "dbias"), pull(cotangent), pull_ref(cotangent)):
    if g_ref is not None:
      np.testing.assert_allclose(g, g_ref, rtol=rtol, atol=rtol * np.abs(g_ref).max(), err_msg=name)


def _blocked(q, k, v, **kw):
  return attention_blocked.attend_blocked(q, k, v, **kw, block=8)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("normalization,value_network", COMBOS)
def test_blocked_equals_reference(normalization, value_network, causal):
  knobs = dict(normalization=normalization, value_network=value_network)
  _assert_same(_blocked, knobs, segment_ids=None, bias=False, causal=causal)
  _assert_same(_blocked, knobs, segment_ids=SEGMENTS_BT, bias=True, causal=causal)


@pytest.mark.parametrize("nonlinearity", ["gelu", "tanh", "identity"])
def test_blocked_hyla_nonlinearities(nonlinearity):
  knobs = dict(normalization="rms_head", value_network="hypernetwork", nonlinearity=nonlinearity)
  _assert_same(_blocked, knobs, segment_ids=SEGMENTS_BT, bias=False)


def test_blocked_skips_tiles_above_the_diagonal():
  """Non-finite values in the last key block reach earlier queries through 0 · NaN unless the tiles
  that pair them are never computed."""
  q, k, v, _, _ = _inputs(T=24)
  v = v.at[:, 16:].set(jnp.nan)
  out = _blocked(q, k, v, normalization="rms_head", value_network="hypernetwork")
  assert np.isfinite(out[:, :16]).all() and np.isnan(out[:, 16:]).all()


def _shapes(jaxpr):
  """Every intermediate shape of a jaxpr, inside loops and custom rules too."""
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      yield getattr(var.aval, "shape", ())
    for sub in jax_core.jaxprs_in_params(eqn.params):
      yield from _shapes(sub)


@pytest.mark.parametrize("impl,preset", [("blocked", "hyla"), ("blocked", "softmax"),
                                         ("chunked", "linear")])
def test_training_never_forms_sequence_squared_tensors(impl, preset):
  """No intermediate of the forward and backward pass has two sequence-length dimensions (the length
  padded to blocks included)."""
  q, k, v, _, _ = _inputs(B=1, T=300, H=2, K=8)
  squared = lambda shape: sum(d in (300, 384) for d in shape) >= 2
  loss = lambda q, k, v: attention.attend(q, k, v, **attention.preset(preset), impl=impl).sum()
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  square = [s for s in _shapes(jaxpr.jaxpr) if squared(s)]
  assert not square, f"{impl} {preset} forms {square}"
  reference = jax.make_jaxpr(jax.grad(lambda q, k, v: attention.attend(
      q, k, v, **attention.preset(preset)).sum(), argnums=(0, 1, 2)))(q, k, v)
  assert any(squared(s) for s in _shapes(reference.jaxpr)), "the check itself finds nothing"


def test_blocked_training_memory_grows_linearly():
  """Compiled forward+backward scratch memory: doubling the length about doubles blocked HYLA's
  (the reference's quadruples)."""
  def temp_bytes(impl, t):
    x = jax.ShapeDtypeStruct((1, t, 2, 8), jnp.float32)
    loss = lambda q, k, v: attention.attend(q, k, v, **attention.preset("hyla"), impl=impl).sum()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes
  blocked = temp_bytes("blocked", 1024) / temp_bytes("blocked", 512)
  reference = temp_bytes("reference", 1024) / temp_bytes("reference", 512)
  assert blocked < 2.5 < 3.5 < reference, (blocked, reference)


def test_chunked_linear_equals_reference():
  knobs = attention.preset("linear")
  chunked = lambda q, k, v, **kw: attention.attend(q, k, v, **kw, impl="chunked")
  _assert_same(chunked, knobs, segment_ids=None, bias=False)
  _assert_same(chunked, knobs, segment_ids=SEGMENTS_BT, bias=False)


def test_chunked_resets_at_every_segment_inside_a_chunk():
  q, k, v, _, cotangent = _inputs(T=40)
  seg_bt = jnp.array([[1] * 3 + [2] * 30 + [3] * 2 + [4] * 5, [1] * 40])
  kw = dict(**attention.preset("linear"), segment_ids=seg_bt)
  np.testing.assert_allclose(
      attention.attend(q, k, v, **kw, impl="chunked"), attention.attend(q, k, v, **kw),
      rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_dot_product_softmax_equals_reference(causal):
  impl = lambda q, k, v, **kw: attention.attend(q, k, v, **kw, impl="dot_product")
  _assert_same(impl, attention.preset("softmax"), segment_ids=SEGMENTS_BT, bias=True, causal=causal)


def test_auto_picks_a_memory_linear_implementation_for_every_variant():
  chosen = {name: attention.choose_impl(knobs["normalization"], knobs["value_network"], causal=True,
                                        bias=None) for name, knobs in attention.PRESETS.items()}
  assert chosen["softmax"] == "auto" and chosen["linear"] == "chunked"
  assert all(impl == "blocked" for name, impl in chosen.items() if name not in ("softmax", "linear"))
  assert attention.choose_impl("none", "linear", causal=True, bias=jnp.zeros(())) == "blocked"
  assert attention.choose_impl("none", "linear", causal=False, bias=None) == "blocked"
  assert model_lib.ModelConfig(V=8).attention_impl == "auto"


@pytest.mark.parametrize("preset", ["softmax", "linear", "hyla"])
def test_auto_model_equals_reference_model(preset):
  outs = []
  for impl in ("auto", "reference"):
    cfg = model_lib.ModelConfig(V=16, D=16, H=2, L=2, F=32, attention=preset, attention_impl=impl,
                                positions="relative_bias")
    tokens_bt = jax.random.randint(jax.random.key(0), (2, 12), 0, 16)
    params = model_lib.Transformer(cfg).init(jax.random.key(1), tokens_bt)
    outs.append(model_lib.Transformer(cfg).apply(params, tokens_bt, segment_ids_bt=SEGMENTS_BT[:, :12])[0])
  np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("knobs,impl,message", [
    (dict(normalization="rms_head", value_network="hypernetwork"), "chunked",
     "'chunked' computes linear attention only"),
    (dict(normalization="none", value_network="linear"), "pallas",
     "'pallas' computes softmax attention only"),
    (dict(normalization="softmax", value_network="linear"), "flash", "unknown attention impl 'flash'"),
])
def test_impl_that_cannot_compute_the_knobs_fails_clearly(knobs, impl, message):
  q, k, v, _, _ = _inputs()
  with pytest.raises(ValueError, match=message):
    attention.attend(q, k, v, **knobs, impl=impl)


@pytest.mark.parametrize("impl,kw,message", [
    ("pallas", dict(), "tiles sequences in blocks of 128, got lengths 21"),
    ("chunked", dict(causal=False), "'chunked' is the causal form"),
])
def test_shapes_an_impl_cannot_take_fail_clearly(impl, kw, message):
  q, k, v, _, _ = _inputs()
  knobs = attention.preset("softmax" if impl == "pallas" else "linear")
  with pytest.raises(ValueError, match=message):
    attention.attend(q, k, v, **knobs, **kw, impl=impl)


def _tpu_topology():
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies
  try:
    return topologies.get_topology_desc("v5e:2x2", "tpu")
  except (RuntimeError, NotImplementedError) as e:
    pytest.skip(f"no libtpu to compile for TPU (pip install -e '.[tpu]'): {e}")


def test_auto_compiles_the_pallas_kernel_for_tpu():
  """Softmax under impl auto, compiled ahead of time for a v5e mesh (batch and heads sharded), runs the
  Pallas kernel forward and backward; HYLA's blocked kernel compiles for the same mesh."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  topology = _tpu_topology()
  mesh = Mesh(np.asarray(topology.devices).reshape(2, 1, 2), ("data", "fsdp", "tensor"))
  x = jax.ShapeDtypeStruct((4, 256, 4, 64), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P(("data", "fsdp"), None, "tensor")))
  seg = jax.ShapeDtypeStruct((4, 256), jnp.int32, sharding=NamedSharding(mesh, P(("data", "fsdp"))))
  for preset, kernels in (("softmax", 3), ("hyla", 0)):
    loss = lambda q, k, v, s: attention.attend(
        q, k, v, **attention.preset(preset), segment_ids=s, impl="auto").sum()
    with jax.set_mesh(mesh):
      lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x, seg)
    assert lowered.as_text().count("tpu_custom_call") == kernels, preset
    assert lowered.compile() is not None


@pytest.mark.parametrize("preset", ["hyla", "hyla_softmax"])
def test_blocked_hypernetwork_pullback_in_bfloat16(preset):
  """The model computes attention in bfloat16: the hand-written hypernetwork pullback keeps the inputs'
  dtype, and its gradients are as close to float32 ones as the reference's computed in bfloat16."""
  q, k, v, _, cotangent = _inputs()
  kw = dict(**attention.preset(preset), segment_ids=SEGMENTS_BT)
  reference = lambda q, k, v: attention.attend(q, k, v, **kw)
  exact = jax.vjp(reference, q, k, v)[1](cotangent)

  def errors(fn):
    out, pull = jax.vjp(fn, *(x.astype(jnp.bfloat16) for x in (q, k, v)))
    grads = pull(cotangent.astype(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    return [np.abs(np.asarray(g, np.float32) - e).max() / np.abs(e).max() for g, e in zip(grads, exact)]

  blocked, rounded = errors(lambda q, k, v: _blocked(q, k, v, **kw)), errors(reference)
  for name, b, r in zip(("dq", "dk", "dv"), blocked, rounded):
    assert b <= 1.5 * r + 1e-3, (name, b, r)
