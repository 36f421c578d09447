"""What only a GPU can show: cuDNN's attention against the reference, the kernels auto runs there, and
a train step's loss. Skipped without a GPU; benchmarks/accelerator_check.py runs them on one (with
--noconftest: nothing here needs tests/conftest.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm import attention

pytestmark = [
    pytest.mark.accelerator,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU"),
]


def _qkv(T=512, H=4, K=64, dtype=jnp.bfloat16):
  return [jax.random.normal(k, (2, T, H, K)).astype(dtype) for k in jax.random.split(jax.random.key(0), 3)]


@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_equals_the_reference_on_gpu(causal):
  q, k, v = _qkv()
  softmax = attention.preset("softmax")
  f = lambda impl: jax.jit(lambda q, k, v: attention.attend(q, k, v, **softmax, causal=causal, impl=impl))
  want = f("reference")(*(x.astype(jnp.float32) for x in (q, k, v)))
  np.testing.assert_allclose(np.float32(f("cudnn")(q, k, v)), want, atol=3e-2, rtol=3e-2)
  grads = [
      jax.grad(lambda q, impl=impl: f(impl)(q, k, v).astype(jnp.float32).sum())(q)
      for impl in ("cudnn", "blocked")
  ]
  np.testing.assert_allclose(np.float32(grads[0]), np.float32(grads[1]), atol=5e-2, rtol=5e-2)


def test_pallas_gpu_equals_the_reference_on_gpu():
  q, k, v = _qkv()
  segment_ids = jnp.asarray([[0] * 200 + [1] * 312, [0] * 512])
  kw = dict(**attention.preset("softmax"), segment_ids=segment_ids)
  got = jax.jit(lambda q, k, v: attention.attend(q, k, v, **kw, impl="pallas_gpu"))(q, k, v)
  want = attention.attend(*(x.astype(jnp.float32) for x in (q, k, v)), **kw)
  np.testing.assert_allclose(np.float32(got), want, atol=3e-2, rtol=3e-2)


def test_auto_lowers_the_gpu_kernels():
  """The compiled program holds cuDNN's fused attention for softmax without segments and a Triton
  kernel with them."""
  q, k, v = _qkv()
  softmax = attention.preset("softmax")
  text = lambda seg: jax.jit(lambda q, k, v: attention.attend(q, k, v, **softmax, impl="auto", segment_ids=seg
                                                             )).lower(q, k, v).compile().as_text()
  assert "cudnn" in text(None).lower()
  assert "triton" in text(jnp.ones((2, 512), jnp.int32)).lower()


def test_a_train_step_on_gpu_gives_a_finite_loss():
  from configs import tiny  # pylint: disable=import-outside-toplevel
  from data_pipelines import pipeline  # pylint: disable=import-outside-toplevel
  from lm.experiment import Experiment  # pylint: disable=import-outside-toplevel
  c = tiny.get_config()
  c.model.update(V=256, D=64, H=2, L=2, F=128, dtype="bfloat16")
  c.data.seq_len, c.train.batch_size = 128, 4
  exp = Experiment(c)
  tokens = np.random.default_rng(0).integers(1, 256, (4, 129)).astype(np.int32)
  segments = np.where(np.arange(129) < 60, 1, 2) * np.ones((4, 1), np.int32)
  positions = np.where(np.arange(129) < 60, np.arange(129), np.arange(129) - 60) * np.ones((4, 1), np.int32)
  batch = pipeline.to_model_batch({
      "inputs": tokens,
      "inputs_segment_ids": segments,
      "inputs_positions": positions
  })
  state, stats = exp.train_step(exp.init_state(), exp.global_batch(batch))
  assert np.isfinite(float(stats["loss"])) and bool(stats["finite"])
  assert int(state.step) == 1
