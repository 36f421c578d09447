"""What `auto` runs on GPU, checked on CPU: the choice per call, the Pallas GPU flash attention in
Pallas's interpreter against the reference, cuDNN's argument checks, and that attend hands the GPU's
choice exactly the arguments its row of IMPLS says it takes. (cuDNN itself needs a GPU:
tests/test_accelerator.py runs it there.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm import attention, model as model_lib
from lm.attention import softmax as attention_softmax


def _gpu(preset, *, t=4096, causal=True, bias=False, dropout=False, segments=False, dtype="bfloat16",
         head_dim=64):
  call = attention.Call(t, t, causal, bias, dropout, segments=segments, dtype=dtype, head_dim=head_dim)
  return attention.choose_impl(attention.Knobs(**attention.preset(preset)), call)["gpu"]


def test_auto_on_gpu_takes_cudnn_where_it_holds_and_pallas_flash_attention_otherwise():
  assert _gpu("softmax") == _gpu("softmax", causal=False) == "cudnn"
  assert _gpu("softmax", dtype="float16") == "cudnn"
  # Packed documents, float32, a head width cuDNN refuses: the Pallas GPU kernel, memory linear too.
  assert _gpu("softmax", segments=True) == "pallas_gpu"
  assert _gpu("softmax", dtype="float32") == "pallas_gpu"
  assert _gpu("softmax", head_dim=160) == _gpu("softmax", head_dim=20) == "pallas_gpu"
  # No fused kernel: XLA's [T, T] form at short lengths only, the blocked kernel beyond.
  assert _gpu("softmax", t=500, segments=True) == "dot_product"
  assert _gpu("softmax", t=1000, segments=True) == "blocked"
  assert _gpu("softmax", t=512, bias=True) == "dot_product"
  assert _gpu("softmax", bias=True) == _gpu("softmax", dropout=True) == "blocked"


def test_auto_on_gpu_takes_chunked_linear_and_blocked_for_everything_else():
  assert _gpu("linear") == _gpu("linear", segments=True, dtype="float32") == "chunked"
  assert _gpu("linear", causal=False) == "blocked"
  assert _gpu("gla") == _gpu("gla", segments=True) == "gla_chunked"
  for name in attention.PRESETS:
    if name not in ("softmax", "linear", "gla"):
      assert _gpu(name) == _gpu(name, segments=True) == "blocked", name


@pytest.mark.parametrize("segments", [True, False, None])
def test_auto_on_gpu_is_memory_linear_at_every_training_length(segments):
  for name in attention.PRESETS:
    for t in (1024, 2048, 4096, 1000):
      # Gated attention takes no dropout (attention.check refuses it).
      for dropout in (False,) if attention.preset(name).get("gated") else (False, True):
        chosen = _gpu(name, t=t, segments=segments, dropout=dropout)
        assert attention.IMPLS[chosen].memory_linear, (name, t, chosen)


def test_layer_impl_reads_the_models_dtype_head_width_and_segments():
  cfg = model_lib.ModelConfig(V=8, D=512, H=8, L=2, attention="softmax,hyla", dtype="bfloat16")
  assert [cfg.layer_impl(layer, 512, "gpu", segments=False) for layer in range(2)] == ["cudnn", "blocked"]
  assert cfg.layer_impl(0, 512, "gpu", segments=True) == "pallas_gpu"
  assert model_lib.ModelConfig(V=8, D=512, H=8, L=2).layer_impl(0, 512, "gpu") == "pallas_gpu"  # float32


@pytest.mark.parametrize("call,message", [
    (dict(segments=True), "'cudnn' takes no packed-document segment ids; use impl 'auto' or 'pallas_gpu'"),
    (dict(dtype="float32"),
     "'cudnn' takes bfloat16 or float16 inputs, got float32; set model.dtype=bfloat16"),
    (dict(head_dim=12), "'cudnn' takes head widths that are a multiple of 8 up to 128, got 12"),
    (dict(head_dim=256), "'cudnn' takes head widths that are a multiple of 8 up to 128, got 256"),
    (dict(bias=True), "'cudnn' takes no position bias"),
    (dict(dropout=True), "'cudnn' applies no attention dropout"),
])
def test_cudnn_refuses_what_it_cannot_take_naming_the_fix(call, message):
  full = dict(q_len=256, k_len=256, causal=True, bias=False, dropout=False, segments=False, dtype="bfloat16",
              head_dim=64)
  with pytest.raises(ValueError, match=message):
    attention.check("cudnn", attention.Knobs(**attention.preset("softmax")), attention.Call(**{
        **full,
        **call
    }))
  with pytest.raises(ValueError, match="computes softmax attention only"):
    attention.check("cudnn", attention.Knobs(**attention.preset("hyla")), attention.Call(**full))


def test_cudnn_asked_for_on_cpu_says_it_runs_on_gpu_only():
  q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="'cudnn' runs on GPU only, not cpu; use impl 'auto'"):
    attention.attend(q, q, q, **attention.preset("softmax"), impl="cudnn")


def test_model_config_refuses_cudnn_for_float32():
  with pytest.raises(ValueError, match="takes bfloat16 or float16 inputs, got float32"):
    model_lib.ModelConfig(V=8, attention="softmax", attention_impl="cudnn")
  model_lib.ModelConfig(V=8, attention="softmax", attention_impl="cudnn", dtype="bfloat16")


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
def test_pallas_gpu_flash_attention_equals_reference_in_interpret_mode(causal):
  """jax's Pallas GPU (Triton) flash attention run by Pallas's interpreter: the same outputs and
  gradients as the definition, packed segments included."""
  q, k, v, cotangent = (
      jax.random.normal(key, (2, 128, 2, 32)) for key in jax.random.split(jax.random.key(3), 4))
  segment_ids = jnp.asarray([[0] * 50 + [1] * 78, [0] * 128])
  kernel = lambda q, k, v: attention_softmax.attend_pallas_gpu(q, k, v, causal=causal, segment_ids=
                                                               segment_ids, interpret=True)
  reference = lambda q, k, v: attention.attend(q, k, v, **attention.preset("softmax"), causal=causal,
                                               segment_ids=segment_ids)

  def out_and_grads(f):
    out, pull = jax.vjp(f, q, k, v)
    return out, pull(cotangent)

  (out, grads), (out_ref, grads_ref) = out_and_grads(kernel), out_and_grads(reference)
  np.testing.assert_allclose(out, out_ref, rtol=1e-4, atol=1e-5)
  for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-4, err_msg=name)


def _traced_gpu_branch(monkeypatch, name, segment_ids):
  """The keyword arguments attend gives implementation `name` when a GPU backend is present: its row's
  function replaced by one that records them (every branch of platform_dependent is traced; only the
  CPU's runs here)."""
  seen = {}

  def fake(q, k, v, **kw):
    seen.update(kw)
    return q

  monkeypatch.setattr(attention, "gpu_backend", lambda: True)
  monkeypatch.setitem(attention.IMPLS, name, attention.IMPLS[name]._replace(fn=fake))
  q = jax.random.normal(jax.random.key(0), (2, 256, 2, 64), jnp.bfloat16)
  out = jax.jit(lambda q: attention.attend(q, q, q, **attention.preset("softmax"), impl="auto", segment_ids=
                                           segment_ids))(q)
  want = attention.attend(q, q, q, **attention.preset("softmax"), segment_ids=segment_ids)
  np.testing.assert_allclose(np.float32(out), np.float32(want), rtol=2e-2, atol=2e-2)  # CPU's own branch ran
  return seen


@pytest.mark.slow
def test_auto_traces_cudnn_for_the_gpu_with_what_its_row_takes(monkeypatch):
  assert _traced_gpu_branch(monkeypatch, "cudnn", None) == {"causal": True}


def test_auto_traces_pallas_gpu_for_packed_documents(monkeypatch):
  segment_ids = jnp.ones((2, 256), jnp.int32)
  seen = _traced_gpu_branch(monkeypatch, "pallas_gpu", segment_ids)
  assert set(seen) == {"causal", "segment_ids"} and seen["causal"]


def test_without_a_gpu_auto_never_traces_the_gpu_kernels(monkeypatch):
  """A CPU or TPU process gives the GPU branch its own choice: cuDNN's wrapper cannot even be traced
  without cuDNN, and the branch is never lowered there."""
  assert not attention.gpu_backend()

  def refuse(*args, **kw):
    raise AssertionError("a GPU kernel was traced on a host without a GPU")

  for name in ("cudnn", "pallas_gpu"):
    monkeypatch.setitem(attention.IMPLS, name, attention.IMPLS[name]._replace(fn=refuse))
  q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
  for segment_ids in (None, jnp.ones((1, 256), jnp.int32)):
    jax.jit(lambda q: attention.attend(q, q, q, **attention.preset("softmax"), impl="auto", segment_ids=
                                       segment_ids))(q)
