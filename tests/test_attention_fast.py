"""The fast attention implementations against impl="reference": values, gradients, memory, kernels."""

import itertools
import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core
from small import python_on_cpu_devices

from lm import attention, model as model_lib
from lm.attention import (
    blocked as attention_blocked,
    core as attention_core,
    hypernetwork as attention_hypernetwork,
    linear as attention_linear,
    softmax as attention_softmax,
)

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


def _out_and_grads(f, args, cotangent):
  """f(*args) and its pullback of `cotangent`, compiled as one program: op by op, each operation of the
  definition, and of a kernel that Pallas interprets, compiles on its own (most of these tests' time)."""

  def run(args, cotangent):
    out, pull = jax.vjp(f, *args)
    return out, pull(cotangent)

  return jax.jit(run)(args, cotangent)


def _assert_same(impl_fn, knobs, *, segment_ids, bias, causal=True, rtol=2e-4, dropout_rate=0.0):
  """impl_fn(q, k, v, bias, **kw) equals the reference in its output and in its pullback of a random
  cotangent with respect to q, k, v (and the bias); with dropout, under the same rng."""
  q, k, v, bias_1hqk, cotangent = _inputs()
  kw = dict(**knobs, causal=causal, segment_ids=segment_ids)
  if dropout_rate:
    kw.update(dropout_rate=dropout_rate, dropout_rng=jax.random.key(7))
  bias = bias_1hqk if bias else None
  reference = lambda q, k, v, b: attention.attend(q, k, v, **kw, bias=b)
  fast = lambda q, k, v, b: impl_fn(q, k, v, **kw, bias=b)
  out_ref, grads_ref = _out_and_grads(reference, (q, k, v, bias), cotangent)
  out, grads = _out_and_grads(fast, (q, k, v, bias), cotangent)
  np.testing.assert_allclose(out, out_ref, rtol=rtol, atol=rtol * np.abs(out_ref).max())
  for name, g, g_ref in zip(("dq", "dk", "dv", "dbias"), grads, grads_ref):
    if g_ref is not None:
      np.testing.assert_allclose(g, g_ref, rtol=rtol, atol=rtol * np.abs(g_ref).max(), err_msg=name)


def _blocked(q, k, v, *, normalization, value_network, nonlinearity="relu", **kw):
  knobs = attention.Knobs(normalization, value_network, nonlinearity)
  return attention_blocked.attend_blocked(q, k, v, knobs=knobs, **kw, block=8)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("normalization,value_network", COMBOS)
def test_blocked_equals_reference(normalization, value_network, causal):
  knobs = dict(normalization=normalization, value_network=value_network)
  _assert_same(_blocked, knobs, segment_ids=None, bias=False, causal=causal)
  _assert_same(_blocked, knobs, segment_ids=SEGMENTS_BT, bias=True, causal=causal)


def test_blocked_softmax_in_one_tile_runs_the_definition():
  """When one tile holds the sequence, blocked softmax attention is the reference: the same values,
  gradients and dropout, and no loop over tiles (its two passes would only repeat work). HYLA keeps
  its tiles there (its written-out pullback is the faster one)."""
  one_tile = lambda q, k, v, *, normalization, value_network, nonlinearity="relu", **kw: (
      attention_blocked.attend_blocked(q, k, v, knobs=attention.Knobs(normalization, value_network,
                                                                      nonlinearity), **kw, block=32))
  _assert_same(one_tile, attention.preset("softmax"), segment_ids=SEGMENTS_BT, bias=True, dropout_rate=0.2)
  q, k, v, _, _ = _inputs()
  loops = lambda name: [
      e for e in jax.make_jaxpr(lambda q: one_tile(q, k, v, **attention.preset(name)).sum())(q).eqns
      if e.primitive.name in ("while", "scan", "custom_vjp_call")
  ]
  assert not loops("softmax")
  assert loops("hyla"), "the check itself sees the tiled kernel"


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("impl,preset", [("blocked", "hyla"), ("blocked", "softmax"), ("chunked", "linear")])
def test_training_never_forms_sequence_squared_tensors(impl, preset):
  """No intermediate of the forward and backward pass has two sequence-length dimensions (the length
  padded to blocks included)."""
  q, k, v, _, _ = _inputs(B=1, T=300, H=2, K=8)
  squared = lambda shape: sum(d in (300, 384) for d in shape) >= 2
  loss = lambda q, k, v: attention.attend(q, k, v, **attention.preset(preset), impl=impl).sum()
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  square = [s for s in _shapes(jaxpr.jaxpr) if squared(s)]
  assert not square, f"{impl} {preset} forms {square}"
  reference = jax.make_jaxpr(
      jax.grad(lambda q, k, v: attention.attend(q, k, v, **attention.preset(preset)).sum(),
               argnums=(0, 1, 2)))(q, k, v)
  assert any(squared(s) for s in _shapes(reference.jaxpr)), "the check itself finds nothing"


@pytest.mark.slow
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


@pytest.mark.slow
def test_chunked_linear_equals_reference():
  knobs = attention.preset("linear")
  chunked = lambda q, k, v, **kw: attention.attend(q, k, v, **kw, impl="chunked")
  _assert_same(chunked, knobs, segment_ids=None, bias=False)
  _assert_same(chunked, knobs, segment_ids=SEGMENTS_BT, bias=False)


@pytest.mark.slow
def test_chunked_resets_at_every_segment_inside_a_chunk():
  q, k, v, _, cotangent = _inputs(T=40)
  seg_bt = jnp.array([[1] * 3 + [2] * 30 + [3] * 2 + [4] * 5, [1] * 40])
  kw = dict(**attention.preset("linear"), segment_ids=seg_bt)
  np.testing.assert_allclose(attention.attend(q, k, v, **kw, impl="chunked"), attention.attend(q, k, v, **kw),
                             rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
def test_splash_equals_reference_in_interpret_mode(causal):
  """The TPU splash kernel run by Pallas's interpreter: the same outputs and gradients as the
  definition, packed segments included (no bias: splash takes none)."""
  q, k, v, cotangent = (
      jax.random.normal(key, (2, 128, 2, 64)) for key in jax.random.split(jax.random.key(3), 4))
  segment_ids = jnp.asarray([[0] * 50 + [1] * 78, [0] * 128])
  splash = lambda q, k, v: attention_softmax.attend_splash(q, k, v, causal=causal, segment_ids=segment_ids,
                                                           interpret=True)
  reference = lambda q, k, v: attention.attend(q, k, v, **attention.preset("softmax"), causal=causal,
                                               segment_ids=segment_ids)
  (out, grads), (out_ref, grads_ref) = (_out_and_grads(f, (q, k, v), cotangent) for f in (splash, reference))
  np.testing.assert_allclose(out, out_ref, rtol=1e-4, atol=1e-5)
  for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("T,causal,segments,tiles", [(384, True, True, 6), (256, False, True, 1),
                                                     (1024, True, False, 3)])
def test_pallas_linear_equals_reference_in_interpret_mode(T, causal, segments, tiles):
  """The TPU linear-attention kernels run by Pallas's interpreter: the same outputs and gradients as the
  definition, in blocks of 128 (3 by 3; causally 6 computed), 256 (one) and 512 (2 by 2; causally 3)."""
  q, k, v, cotangent = (
      jax.random.normal(key, (2, T, 2, 8)) for key in jax.random.split(jax.random.key(5), 4))
  segment_ids = jnp.asarray([[0] * 50 + [1] * (T - 106) + [2] * 56, [0] * T]) if segments else None
  kernel = lambda q, k, v: attention_linear.attend_pallas_linear(q, k, v, causal=causal, segment_ids=
                                                                 segment_ids, interpret=True)
  reference = lambda q, k, v: attention.attend(q, k, v, **attention.preset("linear"), causal=causal,
                                               segment_ids=segment_ids)
  (out, grads), (out_ref, grads_ref) = (_out_and_grads(f, (q, k, v), cotangent) for f in (kernel, reference))
  assert attention_linear.visible_tiles(T, causal) == tiles
  np.testing.assert_allclose(out, out_ref, rtol=1e-4, atol=1e-5 * np.abs(out_ref).max())
  for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5 * np.abs(g_ref).max(), err_msg=name)


def test_pallas_linear_names_a_row_whose_dq_does_not_fit_on_chip():
  """Its backward kernel keeps a row's dq in float32 on chip too (one head: heads are separate grid
  steps): 32 MiB reaches 65,536 tokens; one block more is refused at trace time with the way out."""
  kernel = lambda x: attention_linear.attend_pallas_linear(x, x, x)
  assert jax.eval_shape(kernel, jax.ShapeDtypeStruct((1, 65536, 8, 64), jnp.bfloat16)).shape[1] == 65536
  with pytest.raises(
      ValueError, match="keeps a row's dq on chip, 32.1 MiB at 65664 tokens, more than its "
      "32 MiB; use impl 'chunked'"):
    jax.eval_shape(kernel, jax.ShapeDtypeStruct((1, 65664, 8, 64), jnp.bfloat16))


@pytest.mark.slow
@pytest.mark.parametrize("preset,causal,segments,keep_z", [("hyla", True, True, True),
                                                           ("hyla", False, False, False),
                                                           ("hyla_no_rms_head", True, False, False),
                                                           ("hyla_gelu", False, True, True)])
def test_pallas_hypernetwork_equals_reference_in_interpret_mode(preset, causal, segments, keep_z):
  """The TPU hypernetwork kernels run by Pallas's interpreter: the same outputs and gradients as the
  definition (two query blocks by two key blocks; the causal case skips the tile above the diagonal),
  with z recomputed in the backward pass or kept from the forward (causally: 3 tiles kept of 4)."""
  q, k, v, cotangent = (
      jax.random.normal(key, (2, 256, 2, 8)) for key in jax.random.split(jax.random.key(4), 4))
  segment_ids = jnp.asarray([[0] * 50 + [1] * 150 + [2] * 56, [0] * 256]) if segments else None
  knobs = attention.Knobs(**attention.preset(preset))
  kernel = lambda q, k, v: attention_hypernetwork.attend_pallas_hypernetwork(
      q, k, v, knobs=knobs, causal=causal, segment_ids=segment_ids, interpret=True, keep_z=keep_z)
  reference = lambda q, k, v: attention.attend(q, k, v, **attention.preset(preset), causal=causal, segment_ids
                                               =segment_ids)
  pull = jax.eval_shape(lambda q, k, v: jax.vjp(kernel, q, k, v)[1], q, k, v)
  kept = [x for x in jax.tree.leaves(pull) if x.ndim == 5]  # [rows, tiles, BQ, d, BK]
  assert [x.shape[:2] for x in kept] == ([(2, 3 if causal else 4)] if keep_z else [])
  (out, grads), (out_ref, grads_ref) = (_out_and_grads(f, (q, k, v), cotangent) for f in (kernel, reference))
  np.testing.assert_allclose(out, out_ref, rtol=1e-4, atol=1e-4 * np.abs(out_ref).max())
  for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-4 * np.abs(g_ref).max(), err_msg=name)


@pytest.mark.slow
def test_pallas_kernels_on_each_device_of_a_mesh():
  """Under a mesh of 4 CPU devices (rows over data, heads over tensor), HYLA's and linear attention's
  kernels run on each device's shard (interpret mode; HYLA's gather the heads, linear attention's split
  them) and give the definition's outputs and gradients."""
  script = textwrap.dedent(f"""
      import jax, jax.numpy as jnp, numpy as np
      from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      from lm import attention, sharding
      from lm.attention import hypernetwork as attention_hypernetwork, linear as attention_linear
      import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})
      from test_attention_fast import _out_and_grads
      q, k, v, g = (jax.random.normal(key, (4, 128, 2, 8)) for key in jax.random.split(jax.random.key(6), 4))
      seg = jnp.asarray([[0] * 60 + [1] * 68] * 2 + [[0] * 128] * 2)
      kernels = {{
          "hyla": lambda q, k, v: attention_hypernetwork.attend_pallas_hypernetwork(
              q, k, v, knobs=attention.Knobs(**attention.preset("hyla")), segment_ids=seg,
              batch_axes=sharding.BATCH, interpret=True),
          "linear": lambda q, k, v: attention_linear.attend_pallas_linear(
              q, k, v, segment_ids=seg, batch_axes=sharding.BATCH, interpret=True),
      }}
      mesh = Mesh(np.asarray(jax.devices()).reshape(2, 1, 2), ("data", "fsdp", "tensor"))
      put = lambda x: jax.device_put(x, NamedSharding(mesh, P(sharding.BATCH, None, "tensor")))

      for preset, kernel in kernels.items():
        reference = lambda q, k, v: attention.attend(q, k, v, **attention.preset(preset), segment_ids=seg)
        want = _out_and_grads(reference, (q, k, v), g)
        with jax.set_mesh(mesh):
          out, grads = _out_and_grads(kernel, (put(q), put(k), put(v)), put(g))
        np.testing.assert_allclose(out, want[0], rtol=1e-4, atol=1e-5, err_msg=preset)
        for a, b in zip(grads, want[1]):
          np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=preset)
      print("equal")
      """)
  result = python_on_cpu_devices(script, devices=4)
  assert result.stdout.strip().endswith("equal"), result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("mxu_operands", ["float32", "bfloat16"])
def test_pallas_hypernetwork_in_bfloat16(mxu_operands, monkeypatch):
  """The model's compute dtype: outputs and gradients come back in bfloat16, as close to the float32
  definition as the reference computed in bfloat16 (the kernels compute the tile in float32, and round
  to bfloat16 what they hand the MXU in the backward pass's sums over d and φ(z)'s cotangent). On TPU
  the other per-query products on the MXU round their operands to bfloat16 too (its default
  precision), which the interpreter does not: emulated here by rounding them before the product, with
  z kept from the forward pass in bfloat16, as auto runs the kernels at 512 tokens on TPU."""
  if mxu_operands == "bfloat16":
    exact_products = attention_hypernetwork._per_query
    rounded = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
    monkeypatch.setattr(attention_hypernetwork, "_per_query",
                        lambda x, y, cx, cy: exact_products(rounded(x), rounded(y), cx, cy))
  q, k, v, cotangent = (
      jax.random.normal(key, (1, 128, 2, 16)) for key in jax.random.split(jax.random.key(5), 4))
  kw = dict(**attention.preset("hyla"), segment_ids=jnp.asarray([[0] * 70 + [1] * 58]))
  reference = lambda q, k, v: attention.attend(q, k, v, **kw)
  kernel = lambda q, k, v: attention_hypernetwork.attend_pallas_hypernetwork(
      q, k, v, knobs=attention.Knobs(**attention.preset("hyla")), segment_ids=kw["segment_ids"], interpret=
      True, keep_z=mxu_operands == "bfloat16")
  _assert_bfloat16_as_close_as_the_reference(kernel, reference, (q, k, v), cotangent)


@pytest.mark.slow
@pytest.mark.parametrize("keep_z", [True, False])
def test_pallas_hypernetwork_whole_tiles_in_bfloat16(keep_z):
  """In bfloat16 the backward kernel forms a whole tile's dv and the part of da through z in a loop over
  heads, a few a trip (here 6 heads: 3 trips of 2); causally at 256 tokens the tile below the diagonal
  takes that loop and the two on it the packed rows. Outputs and gradients as close to the float32
  definition as the reference computed in bfloat16, with z kept from the forward pass or recomputed."""
  q, k, v, cotangent = (
      jax.random.normal(key, (1, 256, 6, 16)) for key in jax.random.split(jax.random.key(7), 4))
  assert attention_hypernetwork.heads_per_trip(6) == 2
  kw = dict(**attention.preset("hyla"), segment_ids=jnp.asarray([[0] * 90 + [1] * 166]))
  reference = lambda q, k, v: attention.attend(q, k, v, **kw)
  kernel = lambda q, k, v: attention_hypernetwork.attend_pallas_hypernetwork(
      q, k, v, knobs=attention.Knobs(**attention.preset("hyla")), segment_ids=kw["segment_ids"], interpret=
      True, keep_z=keep_z)
  _assert_bfloat16_as_close_as_the_reference(kernel, reference, (q, k, v), cotangent)


def _assert_bfloat16_as_close_as_the_reference(kernel, reference, qkv, cotangent):
  """kernel's outputs and gradients, from bfloat16 inputs, come back in bfloat16 and are as close to the
  float32 reference as the reference computed in bfloat16 (up to half as far again)."""
  out_exact, grads_exact = _out_and_grads(reference, qkv, cotangent)
  exact = (out_exact, *grads_exact)

  def errors(fn):
    out, grads = _out_and_grads(fn, tuple(x.astype(jnp.bfloat16) for x in qkv),
                                cotangent.astype(jnp.bfloat16))
    values = (out, *grads)
    assert all(x.dtype == jnp.bfloat16 for x in values)
    return [np.abs(np.asarray(x, np.float32) - e).max() / np.abs(e).max() for x, e in zip(values, exact)]

  for name, e_kernel, e_reference in zip(("out", "dq", "dk", "dv"), errors(kernel), errors(reference)):
    assert e_kernel <= 1.5 * e_reference + 1e-3, (name, e_kernel, e_reference)


@pytest.mark.slow
def test_pallas_linear_in_bfloat16():
  """The model's compute dtype. Every operand the linear kernels hand the MXU is already in it (q, k, v,
  g, and the scores and their cotangent rounded to it, as the chunked form rounds the scores), so the
  interpreter's products are the TPU's."""
  q, k, v, cotangent = (
      jax.random.normal(key, (1, 256, 2, 64)) for key in jax.random.split(jax.random.key(8), 4))
  kw = dict(**attention.preset("linear"), segment_ids=jnp.asarray([[0] * 70 + [1] * 186]))
  kernel = lambda q, k, v: attention_linear.attend_pallas_linear(q, k, v, segment_ids=kw["segment_ids"],
                                                                 interpret=True)
  _assert_bfloat16_as_close_as_the_reference(kernel, lambda q, k, v: attention.attend(q, k, v, **kw),
                                             (q, k, v), cotangent)


@pytest.mark.slow
def test_auto_softmax_traces_again_at_a_length_splash_tiles():
  """On CPU, auto still traces the TPU branch (splash) of softmax attention: a second trace, as
  lm-train's initialisation then train step make, must not meet values of the first."""
  q = jax.random.normal(jax.random.key(0), (1, 128, 2, 16))
  attend = lambda q: attention.attend(q, q, q, **attention.preset("softmax"), impl="auto")
  first = jax.jit(attend)(q)
  np.testing.assert_allclose(jax.jit(lambda q: attend(q) * 2)(q), 2 * first, rtol=1e-6)
  assert jax.grad(lambda q: attend(q).sum())(q).shape == q.shape


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
def test_dot_product_softmax_equals_reference(causal):
  impl = lambda q, k, v, **kw: attention.attend(q, k, v, **kw, impl="dot_product")
  _assert_same(impl, attention.preset("softmax"), segment_ids=SEGMENTS_BT, bias=True, causal=causal)


def _chosen(preset, *, t=4096, causal=True, bias=False, dropout=False):
  return attention.choose_impl(attention.Knobs(**attention.preset(preset)),
                               attention.Call(t, t, causal, bias, dropout))


@pytest.mark.parametrize("dropout", [False, True])
def test_auto_picks_a_memory_linear_implementation_for_every_variant(dropout):
  """At training lengths, on CPU, TPU and GPU, for every preset, with and without dropout
  (tests/test_attention_gpu.py has the GPU's choices in detail)."""
  for name in attention.PRESETS:
    if dropout and attention.preset(name).get("gated"):
      continue  # gated attention takes no dropout (attention.check refuses it)
    chosen = _chosen(name, dropout=dropout)
    assert all(attention.IMPLS[chosen[p]].memory_linear for p in attention.PLATFORMS), (name, chosen)
  assert _chosen("softmax") == {"cpu": "blocked", "tpu": "splash", "gpu": "cudnn"}
  assert _chosen("softmax", bias=True)["tpu"] == "pallas"  # splash takes no bias
  assert _chosen("softmax", t=512)["cpu"] == "dot_product"
  assert _chosen("linear") == {"cpu": "chunked", "tpu": "pallas_linear", "gpu": "chunked"}
  assert _chosen("hyla") == {"cpu": "blocked", "tpu": "pallas_hypernetwork", "gpu": "blocked"}
  assert _chosen("hyla_no_rms_head")["tpu"] == "pallas_hypernetwork"
  # Up to 512 tokens, HYLA's kernels keep z for the backward pass (memory quadratic in the length).
  assert _chosen("hyla", t=512)["tpu"] == _chosen("hyla_no_rms_head",
                                                  t=512)["tpu"] == "pallas_hypernetwork_keep_z"
  assert _chosen("hyla", t=640)["tpu"] == "pallas_hypernetwork"
  assert [name for name in attention.IMPLS if attention.keeps_z(name)] == ["pallas_hypernetwork_keep_z"]
  assert _chosen("hyla_softmax")["tpu"] == "blocked"  # softmax couples the keys: not in the kernels
  assert _chosen("hyla", bias=True)["tpu"] == "blocked" and _chosen("hyla", dropout=True)["tpu"] == "blocked"
  assert set(_chosen("linear", bias=True).values()) == {"blocked"}
  assert _chosen("linear", causal=False) == {"cpu": "blocked", "tpu": "pallas_linear", "gpu": "blocked"}
  assert model_lib.ModelConfig(V=8).attention_impl == "auto"


def test_auto_skips_implementations_that_cannot_drop():
  for name in ("softmax", "linear", "hyla"):
    chosen = _chosen(name, dropout=True)
    assert all(attention.IMPLS[impl].dropout for impl in chosen.values()), (name, chosen)
  assert set(_chosen("softmax", dropout=True).values()) == {"blocked"}


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["softmax", "linear", "hyla"])
def test_auto_model_equals_reference_model(preset):
  outs = []
  for impl in ("auto", "reference"):
    cfg = model_lib.ModelConfig(V=16, D=16, H=2, L=2, F=32, attention=preset, attention_impl=impl,
                                positions="relative_bias")
    tokens_bt = jax.random.randint(jax.random.key(0), (2, 12), 0, 16)
    params = model_lib.Transformer(cfg).init(jax.random.key(1), tokens_bt)
    outs.append(model_lib.Transformer(cfg).apply(params, tokens_bt, segment_ids_bt=SEGMENTS_BT[:, :12]))
  np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("knobs,impl,message", [
    (dict(normalization="rms_head",
          value_network="hypernetwork"), "chunked", "'chunked' computes linear attention only"),
    (dict(normalization="none",
          value_network="linear"), "pallas", "'pallas' computes softmax attention only"),
    (dict(normalization="softmax", value_network="hypernetwork"), "pallas_hypernetwork",
     "'pallas_hypernetwork' computes hyla and hyla_no_rms_head attention only \\(normalization/value_network "
     "rms_head/hypernetwork or none/hypernetwork\\), not softmax/hypernetwork"),
    (dict(normalization="softmax", value_network="linear"), "flash", "unknown attention impl 'flash'"),
])
def test_impl_that_cannot_compute_the_knobs_fails_clearly(knobs, impl, message):
  q, k, v, _, _ = _inputs()
  with pytest.raises(ValueError, match=message):
    attention.attend(q, k, v, **knobs, impl=impl)


@pytest.mark.parametrize("impl,kw,message", [
    ("pallas", dict(), "tiles sequences in blocks of 128, got lengths 21"),
    ("chunked", dict(causal=False), "'chunked' computes causal attention only"),
    ("chunked", dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "'chunked' applies no attention "
     "dropout"),
    ("blocked", dict(k=jnp.zeros((2, 5, 3, 4))), "needs as many keys as queries, got 21 and 5"),
    ("pallas_hypernetwork", dict(), "tiles sequences in blocks of 128, got lengths 21"),
    ("pallas_linear", dict(), "tiles sequences in blocks of 128, got lengths 21"),
    ("chunked", dict(positions=(jnp.arange(21), jnp.arange(21))),
     "'chunked' takes no explicit query and key positions; use impl 'auto' or 'reference'"),
])
def test_shapes_an_impl_cannot_take_fail_clearly(impl, kw, message):
  q, k, v, _, _ = _inputs()
  knobs = attention.preset({"pallas": "softmax", "pallas_hypernetwork": "hyla"}.get(impl, "linear"))
  k = kw.pop("k", k)
  with pytest.raises(ValueError, match=message):
    attention.attend(q, k, v, **knobs, **kw, impl=impl)


def test_pallas_hypernetwork_diagonal_rows_hold_each_query_once_with_its_keys():
  """A causal diagonal tile's packed rows (attention_hypernetwork._row_sets): every query of the tile in
  exactly one row, each with room on its lanes for every key it sees (keys 0..q of the tile), in 72 rows
  for 128 queries; off the diagonal, one row per query."""
  hyper = attention_hypernetwork
  for diagonal, rows in ((False, hyper.BLOCK_Q), (True, 72)):
    sets = hyper._row_sets(diagonal)
    starts = [(r.lo, r.n) for r in sets] + [(r.hi, r.n) for r in sets if r.hi is not None]
    assert sorted(q for lo, n in starts for q in range(lo, lo + n)) == list(range(hyper.BLOCK_Q))
    assert sum(r.n for r in sets) == rows
  for r in hyper._row_sets(True):
    assert r.lo + r.n <= r.split  # the lo queries' last key fits below split
    assert r.hi is None or r.hi + r.n <= hyper.BLOCK_K - r.split  # the hi queries' keys above it


def test_pallas_hypernetwork_names_a_row_whose_dq_does_not_fit_on_chip():
  """The backward kernel keeps a row's dq in float32 on chip: 64 MiB reaches 32,768 tokens at 8 heads
  of 64 per device; one tile more is refused at trace time with the way out, not by the TPU compiler."""
  knobs = attention.Knobs(**attention.preset("hyla"))
  kernel = lambda x: attention_hypernetwork.attend_pallas_hypernetwork(x, x, x, knobs=knobs)
  assert jax.eval_shape(kernel, jax.ShapeDtypeStruct((1, 32768, 8, 64), jnp.bfloat16)).shape[1] == 32768
  with pytest.raises(
      ValueError, match="keeps a row's dq on chip, 64.2 MiB at 32896 tokens and 8 heads of 64 "
      "per device, more than its 64 MiB; use impl 'blocked'"):
    jax.eval_shape(kernel, jax.ShapeDtypeStruct((1, 32896, 8, 64), jnp.bfloat16))


@pytest.mark.slow
def test_auto_compiles_the_pallas_kernel_for_tpu(v5e_2x2):
  """Softmax, HYLA and linear attention under impl auto, compiled ahead of time for a v5e mesh (batch and
  heads sharded), run their Pallas kernels forward and backward (splash: a forward and a fused backward
  kernel; the hypernetwork and linear kernels: one each; value_and_grad, since with the gradient alone
  the hypernetwork forward kernel's output goes unused, its residuals being its inputs, and newer jax
  drops it)."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  topology = v5e_2x2
  mesh = Mesh(np.asarray(topology.devices).reshape(2, 1, 2), ("data", "fsdp", "tensor"))
  x = jax.ShapeDtypeStruct((4, 256, 4, 64), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P(("data", "fsdp"), None, "tensor")))
  seg = jax.ShapeDtypeStruct((4, 256), jnp.int32, sharding=NamedSharding(mesh, P(("data", "fsdp"))))
  # softmax: the splash kernel forward and its fused backward.
  for preset, kernels in (("softmax", 2), ("hyla", 2), ("linear", 2)):
    loss = lambda q, k, v, s: attention.attend(q, k, v, **attention.preset(preset), segment_ids=s, impl="auto"
                                              ).sum()
    with jax.set_mesh(mesh):
      lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(x, x, x, seg)
    assert lowered.as_text().count("tpu_custom_call") == kernels, preset
    assert lowered.compile() is not None


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["hyla", "hyla_softmax"])
def test_blocked_hypernetwork_pullback_in_bfloat16(preset):
  """The model computes attention in bfloat16: the hand-written hypernetwork pullback keeps the inputs'
  dtype, and its gradients are as close to float32 ones as the reference's computed in bfloat16."""
  q, k, v, _, cotangent = _inputs()
  kw = dict(**attention.preset(preset), segment_ids=SEGMENTS_BT)
  reference = lambda q, k, v: attention.attend(q, k, v, **kw)
  exact = _out_and_grads(reference, (q, k, v), cotangent)[1]

  def errors(fn):
    out, grads = _out_and_grads(fn, tuple(x.astype(jnp.bfloat16) for x in (q, k, v)),
                                cotangent.astype(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    return [np.abs(np.asarray(g, np.float32) - e).max() / np.abs(e).max() for g, e in zip(grads, exact)]

  blocked, rounded = errors(lambda q, k, v: _blocked(q, k, v, **kw)), errors(reference)
  for name, b, r in zip(("dq", "dk", "dv"), blocked, rounded):
    assert b <= 1.5 * r + 1e-3, (name, b, r)


@pytest.mark.slow
def test_dropout_mask_is_one_mask_that_any_tile_draws_its_part_of():
  rng = jax.random.key(3)
  full = attention_core.dropout_keep(rng, jnp.arange(64), jnp.arange(64), 0.25)
  assert full.shape == (1, 1, 64, 64)  # shared over batch and heads
  tile = attention_core.dropout_keep(rng, 16 + jnp.arange(16), 48 + jnp.arange(16), 0.25)
  np.testing.assert_array_equal(tile, full[:, :, 16:32, 48:64])
  assert 0.70 < float(full.mean()) < 0.80
  other = attention_core.dropout_keep(jax.random.key(4), jnp.arange(64), jnp.arange(64), 0.25)
  assert float((other != full).mean()) > 0.2


@pytest.mark.slow
@pytest.mark.parametrize("normalization,value_network", COMBOS)
def test_blocked_dropout_equals_reference_under_the_same_mask(normalization, value_network):
  """Tiles of 8 over 21 tokens: each tile's part of the mask, forward and in both backward passes."""
  knobs = dict(normalization=normalization, value_network=value_network)
  _assert_same(_blocked, knobs, segment_ids=SEGMENTS_BT, bias=True, dropout_rate=0.3)


@pytest.mark.slow
@pytest.mark.parametrize("impl", [n for n, i in attention.IMPLS.items() if i.dropout and n != "reference"])
def test_every_dropping_impl_equals_reference_under_the_same_mask(impl):
  fast = lambda q, k, v, **kw: attention.attend(q, k, v, **kw, impl=impl)
  _assert_same(fast, attention.preset("hyla"), segment_ids=SEGMENTS_BT, bias=False, causal=False,
               dropout_rate=0.3)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["softmax", "hyla"])
def test_model_dropout_takes_the_fast_kernel_with_the_reference_mask(preset):
  tokens_bt = jax.random.randint(jax.random.key(0), (2, 12), 0, 16)
  outs = []
  for impl in ("auto", "reference"):
    cfg = model_lib.ModelConfig(V=16, D=16, H=2, L=2, F=32, attention=preset, attention_impl=impl,
                                attention_dropout=0.2)
    m = model_lib.Transformer(cfg)
    params = m.init(jax.random.key(1), tokens_bt)
    # Compiled, not op by op: eagerly every operation of the model compiles on its own.
    run = jax.jit(
        lambda p, d: m.apply(p, tokens_bt, segment_ids_bt=SEGMENTS_BT[:, :12], deterministic=d, rngs=
                             {"dropout": jax.random.key(2)}), static_argnums=1)
    outs.append(jax.jit(jax.value_and_grad(lambda p: run(p, False).sum()))(params))
    assert not np.allclose(run(params, False), run(params, True))
  (auto, g_auto), (ref, g_ref) = outs
  np.testing.assert_allclose(auto, ref, rtol=1e-4)
  for a, r in zip(jax.tree.leaves(g_auto), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, r, rtol=1e-3, atol=1e-4 * np.abs(r).max())


def test_training_with_dropout_never_forms_sequence_squared_tensors():
  """The model's gradient with attention dropout on (HYLA, impl auto) holds no [b, h, t, t]."""
  cfg = model_lib.ModelConfig(V=16, D=16, H=2, L=1, F=32, attention="hyla", attention_dropout=0.1)
  tokens_bt = jnp.zeros((1, 300), jnp.int32)
  m = model_lib.Transformer(cfg)
  params = jax.eval_shape(m.init, jax.random.key(1), tokens_bt[:, :8])
  loss = lambda p: m.apply(p, tokens_bt, deterministic=False, rngs={"dropout": jax.random.key(2)}).sum()
  shapes = list(_shapes(jax.make_jaxpr(jax.grad(loss))(params).jaxpr))
  assert not [s for s in shapes if sum(d in (300, 320) for d in s) >= 2]
  assert any(s[:2] == (1, 300) for s in shapes), "the check itself sees the sequence"


@pytest.mark.parametrize("fields,message", [
    (dict(attention="linear", attention_impl="chunked",
          attention_dropout=0.1), "'chunked' applies no attention dropout"),
    (dict(attention="hyla", attention_impl="pallas"), "'pallas' computes softmax attention only"),
    (dict(attention_dropout=1.0), r"attention_dropout must be in \[0, 1\)"),
])
def test_model_config_checks_the_impl_against_the_table(fields, message):
  with pytest.raises(ValueError, match=message):
    model_lib.ModelConfig(V=8, **fields)
