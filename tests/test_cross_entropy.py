"""The readout's cross-entropy: the Pallas kernels (run here in interpret mode) and the fused form compute
the same loss and gradients as the plain form, alone and under a mesh; auto takes the fused form on CPU
and compiles the kernels for TPU."""

import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from small import python_on_cpu_devices

from lm import cross_entropy

# Two token blocks of the forward kernel, 16 of the backward kernel; one vocabulary block of 2,048 in
# both, unless a test narrows them.
B, T, D, V = 2, 2048, 64, 2048


def _problem(dtype=jnp.float32):
  kx, kw, ky = jax.random.split(jax.random.key(0), 3)
  x_btd = jax.random.normal(kx, (B, T, D), jnp.float32).astype(dtype)
  w_dv = (jax.random.normal(kw, (D, V), jnp.float32) * 0.3).astype(dtype)
  targets_bt = jax.random.randint(ky, (B, T), 0, V)
  # Unequal weights per token, so that a gradient that mixed up tokens would show.
  weights_bt = jnp.linspace(0.0, 2.0, B * T).reshape(B, T)
  return x_btd, w_dv, targets_bt, weights_bt


def _loss_and_grads(impl, scale, x_btd, w_dv, targets_bt, weights_bt):
  f = lambda x, w: cross_entropy.readout_loss(x, w, scale, targets_bt, weights_bt, impl=impl, interpret=True)
  return jax.jit(jax.value_and_grad(f, (0, 1)))(x_btd, w_dv)


def test_token_nll_is_log_softmax_at_the_target():
  logits = jax.random.normal(jax.random.key(1), (2, 3, 7)) * 5
  targets = jnp.asarray([[0, 6, 3], [2, 2, 5]])
  want = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)),
                             np.asarray(targets)[..., None], -1)[..., 0]
  np.testing.assert_allclose(cross_entropy.token_nll(logits, targets), want, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["pallas", "pallas_keep_logits"])
@pytest.mark.parametrize("scale,chunks", [(1.0, 1), (0.125, 4)])
def test_kernels_equal_the_plain_form_in_float32(impl, scale, chunks, monkeypatch):
  """With the backward kernel's dx in one chunk of the 4,096 tokens or in 4 (whose partial dw are summed),
  over two vocabulary blocks in both kernels; the logits recomputed or kept from the forward kernel."""
  monkeypatch.setattr(cross_entropy, "BLOCK_VOCAB_ELEMENTS", D * 1024)
  monkeypatch.setattr(cross_entropy, "DX_CHUNK_BYTES", B * T * D * 4 // chunks)
  assert cross_entropy.dx_chunk(B * T, D, cross_entropy.BLOCK_TOKENS_BWD) == B * T // chunks
  problem = _problem()
  (loss, (dx, dw)), (want_loss, (want_dx,
                                 want_dw)) = (_loss_and_grads(i, scale, *problem) for i in (impl, "xla"))
  assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
  np.testing.assert_allclose(dx, want_dx, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(dw, want_dw, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("scale", [1.0, 0.125])
@pytest.mark.parametrize("tokens", [2048, 700])
def test_the_fused_form_equals_the_plain_form(scale, tokens):
  """Its loss and both gradients, and the gradient of the weights, in float32; 700 tokens are padded to
  whole blocks with tokens of weight 0."""
  x, w, y, weights = (a[:, :tokens] if a.ndim > 1 and a.shape[1] == T else a for a in _problem())
  loss = lambda impl: jax.jit(
      jax.value_and_grad(lambda x, w, wt: cross_entropy.readout_loss(x, w, scale, y, wt, impl=impl) * 3.0,
                         (0, 1, 2)))(x, w, weights)
  (got, got_grads), (want, want_grads) = loss("fused"), loss("xla")
  assert float(got) == pytest.approx(float(want), rel=1e-6)
  for a, b in zip(got_grads, want_grads):
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_fused_form_in_bfloat16_is_as_close_to_float32_as_the_plain_form():
  """Both form the logits in the compute dtype; the fused form's gradients are no further from float32's
  than the plain form's (measured: 0.3-0.5% of the largest entry, the plain form's 0.5-1.2%)."""
  x, w, y, weights = _problem(jnp.bfloat16)
  _, exact = _loss_and_grads("xla", 1.0, x.astype(jnp.float32), w.astype(jnp.float32), y, weights)
  (got, grads), (want, plain) = (_loss_and_grads(i, 1.0, x, w, y, weights) for i in ("fused", "xla"))
  assert grads[0].dtype == grads[1].dtype == jnp.bfloat16
  assert float(got) == pytest.approx(float(want), rel=1e-4)
  error = lambda a, b: float(np.abs(np.asarray(a, np.float32) - b).max() / np.abs(b).max())
  for ours, theirs, e in zip(grads, plain, exact):
    assert error(ours, e) < 0.01 and error(ours, e) <= error(theirs, e)


def test_kept_logits_give_the_numbers_of_recomputed_ones():
  """The backward kernel reading the forward kernel's float32 logits computes what it computes when it
  forms them again, to float32's rounding of the readout's product (the two kernels take it in blocks
  of different sizes): in float32, 100 times closer than either is to the plain form (test above)."""
  (loss,
   grads), (want,
            want_grads) = (_loss_and_grads(i, 0.5, *_problem()) for i in ("pallas_keep_logits", "pallas"))
  assert float(loss) == pytest.approx(float(want), rel=1e-7)
  for a, b in zip(grads, want_grads):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.abs(b).max()))


def test_kernels_in_bfloat16_keep_the_logits_in_float32():
  """With bfloat16 inputs the kernels are closer to the float32 loss than the plain form, which rounds
  the logits to bfloat16 as the model's forward pass does."""
  x, w, y, weights = _problem(jnp.bfloat16)
  exact, exact_grads = _loss_and_grads("xla", 1.0, x.astype(jnp.float32), w.astype(jnp.float32), y, weights)
  bf16 = (x, w, y, weights)
  (kernels, grads), (plain, _) = (_loss_and_grads(impl, 1.0, *bf16) for impl in ("pallas", "xla"))
  assert grads[0].dtype == grads[1].dtype == jnp.bfloat16
  assert abs(float(kernels) - float(exact)) < abs(float(plain) - float(exact))
  # Gradients within bfloat16's rounding of float32's (measured: 0.3-0.4% of the largest entry).
  for ours, e in zip(grads, exact_grads):
    assert float(np.abs(np.asarray(ours, np.float32) - e).max() / np.abs(e).max()) < 0.01


@pytest.mark.parametrize("impl, tokens, V, message", [
    ("fast", 2048, 256,
     "unknown train.cross_entropy_impl 'fast'; choose one of: auto, xla, pallas, pallas_keep_logits, fused"),
    ("fused", 2048, 256, "'fused' gives the weighted sum of the losses (readout_loss), not each token's"),
    ("pallas", 2048, 300, "the vocabulary (300) is not a multiple of 128"),
    ("pallas", 1024, 256, "the tokens per device (1024) are not a multiple of 2048"),
    ("pallas_keep_logits", 1024, 256,
     "'pallas_keep_logits': the tokens per device (1024) are not a multiple"),
])
def test_what_the_kernels_cannot_take_fails_clearly(impl, tokens, V, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    cross_entropy.readout_nll(jnp.zeros((1, tokens, 8)), jnp.zeros((8, V)), 1.0,
                              jnp.zeros((1, tokens), jnp.int32), impl=impl)


def test_auto_takes_the_plain_form_per_token_and_the_fused_form_for_the_sum_on_cpu():
  x, w, y, weights = _problem()
  per_token = jax.jit(lambda x, w: cross_entropy.readout_nll(x, w, 1.0, y)).lower(x, w).as_text()
  assert "tpu_custom_call" not in per_token and "stablehlo.while" not in per_token
  # The fused form's loop over token blocks is the only loop in the loss.
  loss = lambda x, w: cross_entropy.readout_loss(x, w, 1.0, y, weights)
  summed = jax.jit(jax.grad(loss, (0, 1))).lower(x, w).as_text()
  assert "tpu_custom_call" not in summed and "stablehlo.while" in summed


def test_auto_takes_the_fused_form_on_gpu_as_on_cpu():
  """readout_loss's platform_dependent: CUDA and ROCm lower the branch CPU lowers (the fused form, a
  custom_vjp over token blocks), TPU the default (readout_nll's kernels)."""
  x, w, y, weights = _problem()
  jaxpr = jax.make_jaxpr(lambda x, w: cross_entropy.readout_loss(x, w, 1.0, y, weights))(x, w).jaxpr
  cond = next(e for e in jaxpr.eqns if e.primitive.name == "cond" and e.params.get("branches_platforms"))
  platforms = cond.params["branches_platforms"]
  branch = lambda p: next(i for i, ps in enumerate(platforms) if ps is None or p in ps)
  assert branch("cuda") == branch("rocm") == branch("cpu") != branch("tpu")
  fused = cond.params["branches"][branch("cuda")].jaxpr
  assert "custom_vjp_call" in {e.primitive.name for e in fused.eqns}


@pytest.mark.slow
def test_kernels_and_the_fused_form_under_a_mesh_sum_the_readouts_gradient_over_devices():
  """Four CPU devices, rows sharded over `data`: each device's kernels (or fused pass) see their rows
  only, and w's gradient is the sum over devices (shard_map's transpose), equal to the unsharded one."""
  script = textwrap.dedent(f"""
      import jax, jax.numpy as jnp, numpy as np
      from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})
      from test_cross_entropy import _problem, _loss_and_grads
      x, w, y, weights = _problem()
      x, y, weights = (jnp.concatenate([a, a[::-1]]) for a in (x, y, weights))  # 4 rows: 2,048 tokens a device
      want = _loss_and_grads("xla", 0.5, x, w, y, weights)
      mesh = Mesh(np.asarray(jax.devices()).reshape(4, 1, 1), ("data", "fsdp", "tensor"))
      rows = NamedSharding(mesh, P(("data", "fsdp")))
      for impl in ("pallas", "pallas_keep_logits", "fused"):
        with jax.set_mesh(mesh):
          got = _loss_and_grads(impl, 0.5, jax.device_put(x, rows), w, jax.device_put(y, rows),
                                jax.device_put(weights, rows))
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
        for a, b in zip(got[1], want[1]):
          np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
      print("equal")
      """)
  result = python_on_cpu_devices(script, devices=4)
  assert result.stdout.strip().endswith("equal"), result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("rows,D,keep", [(8, 256, False), (32, 1024, True)])
def test_auto_compiles_the_kernels_for_tpu(v5e_2x2, rows, D, keep, monkeypatch):
  """Under impl auto, a step lowered for a v5e mesh (rows sharded over 4 chips) runs the forward and the
  backward kernel, and compiles within the chip's VMEM: 2,048 tokens a chip of width 256 with the logits
  over the size kept (so recomputed), and 8,192 of width 1,024, whose 1 GB of float32 logits are kept
  and whose dx the backward kernel holds in two chunks."""
  if not keep:
    monkeypatch.setattr(cross_entropy, "KEEP_LOGITS_BYTES", 4 * 2048 * 32_000 - 1)
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.asarray(v5e_2x2.devices).reshape(4, 1, 1), ("data", "fsdp", "tensor"))
  batch = NamedSharding(mesh, P(("data", "fsdp")))
  x = jax.ShapeDtypeStruct((rows, 1024, D), jnp.bfloat16, sharding=batch)
  w = jax.ShapeDtypeStruct((D, 32_000), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  y = jax.ShapeDtypeStruct((rows, 1024), jnp.int32, sharding=batch)
  assert cross_entropy.dx_chunk(rows // 4 * 1024, D,
                                cross_entropy.BLOCK_TOKENS_BWD) == min(rows // 4, 4) * 1024
  loss = lambda x, w, y: cross_entropy.readout_loss(x, w, 1.0, y, jnp.ones(y.shape))
  with jax.set_mesh(mesh):
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w, y)
  text = lowered.as_text()
  assert all(name in text for name in ("cross_entropy_fwd", "cross_entropy_bwd"))
  assert (f"{rows // 4 * 1024}x32000xf32" in text) == keep
  assert lowered.compile() is not None
