"""The transformer around the attention core: causality end to end, parameters, codes, positions."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import ad_checkpoint
from jax.extend import core as jax_core

from lm import attention, checkpointing, cross_entropy, flops, model as model_lib, rounding


def _transformer(**kw) -> model_lib.Transformer:
  return model_lib.Transformer(model_lib.ModelConfig(**{"V": 50, "D": 32, "H": 4, "L": 2, "F": 64, **kw}))


def _model(**kw):
  m = _transformer(**kw)
  tokens_bt = jax.random.randint(jax.random.key(0), (2, 12), 0, m.cfg.V)
  # Compiled: op by op, each of the initialisers' operations compiles on its own.
  return m, jax.jit(m.init)(jax.random.key(1), tokens_bt)["params"], tokens_bt


def _output_and_grads(model, params, tokens_bt):
  """The model's output and the gradient of the sum of its squares, as one jitted program (op by op,
  every operation compiles on its own, which took most of these tests' time)."""

  def loss(p):
    out = model.apply({"params": p}, tokens_bt)
    return jnp.sum(out**2), out

  grads, out = jax.jit(jax.grad(loss, has_aux=True))(params)
  return out, grads


@pytest.mark.slow
@pytest.mark.parametrize("name", list(attention.PRESETS))
def test_every_preset_is_causal_end_to_end(name):
  m, params, tokens_bt = _model(attention=name)
  logits = m.apply({"params": params}, tokens_bt)
  t = 5
  changed = tokens_bt.at[:, t + 1:].set((tokens_bt[:, t + 1:] + 1) % 50)
  logits2 = m.apply({"params": params}, changed)
  np.testing.assert_allclose(logits[:, :t + 1], logits2[:, :t + 1], rtol=1e-5, atol=1e-5)
  assert not np.allclose(logits[:, t + 1:], logits2[:, t + 1:])


@pytest.mark.slow
@pytest.mark.parametrize("positions", model_lib.POSITIONS)
def test_packed_documents_do_not_see_each_other(positions):
  m, params, tokens_bt = _model(attention="hyla", positions=positions)
  seg_bt = jnp.array([[1] * 5 + [2] * 7] * 2)
  pos_bt = jnp.array([list(range(5)) + list(range(7))] * 2)
  run = lambda t: m.apply({"params": params}, t, positions_bt=pos_bt, segment_ids_bt=seg_bt)
  changed = tokens_bt.at[:, :5].set((tokens_bt[:, :5] + 3) % 50)
  np.testing.assert_allclose(run(tokens_bt)[:, 5:], run(changed)[:, 5:], rtol=1e-5, atol=1e-5)
  # The second document alone, at the start of a row, gives the same outputs: positions restart.
  alone = m.apply({"params": params}, tokens_bt[:, 5:])
  np.testing.assert_allclose(run(tokens_bt)[:, 5:], alone, rtol=1e-4, atol=1e-4)


def _param_shapes(**kw):
  """The parameters _model(**kw) creates, as shapes: traced, not run."""
  return jax.eval_shape(_transformer(**kw).init, jax.random.key(1), jnp.zeros((2, 12), jnp.int32))["params"]


def test_variants_have_identical_parameter_counts():
  """The paper's variants add no parameters; a gated one adds only its gate's (GLA: W1, W2, b)."""
  counts = {name: model_lib.count_params(_param_shapes(attention=name)) for name in attention.PRESETS}
  ungated = {n: c for n, c in counts.items() if not attention.preset(n).get("gated")}
  assert len(set(ungated.values())) == 1, counts
  D, L, F, V = 32, 2, 64, 50
  per_block = 4 * D * D + 2 * D * F + 2 * 2 * D  # q,k,v,o; MLP; two LayerNorms
  assert counts["hyla"] == V * D + L * per_block + 2 * D + D * V
  r = model_lib.GATE_RANK
  assert counts["gla"] - counts["linear"] == L * (D * r + r * D + D)


def test_tied_embeddings_drop_the_output_matrix():
  untied = model_lib.count_params(_param_shapes())
  tied = model_lib.count_params(_param_shapes(tied_embeddings=True))
  assert untied - tied == 32 * 50


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_the_readout_forms_the_models_logits(tied):
  """What the language-modelling loss gets instead of logits (return_readout) forms the same logits,
  and its cross-entropy is the one of those logits."""
  model, params, tokens = _model(tied_embeddings=tied)
  logits = model.apply({"params": params}, tokens)
  readout = model.apply({"params": params}, tokens, return_readout=True)
  assert readout.w_dv.shape == (32, 50) and readout.scale == (32**-0.5 if tied else 1.0)
  np.testing.assert_array_equal(readout.logits().astype(jnp.float32), logits)
  np.testing.assert_array_equal(cross_entropy.readout_nll(*readout, tokens, impl="xla"),
                                cross_entropy.token_nll(logits, tokens))


@pytest.mark.slow
def test_latent_codes_are_the_normalised_scores_and_do_not_change_outputs():
  m, params, tokens_bt = _model(attention="hyla", L=3)
  plain = m.apply({"params": params}, tokens_bt)
  logits, _ = m.apply({"params": params}, tokens_bt, mutable="codes")
  codes = model_lib.latent_codes(m, params, tokens_bt)
  assert len(codes) == 3
  # Asking for codes changes nothing else: the same outputs, the same kernel (impl auto).
  np.testing.assert_allclose(plain, logits, rtol=1e-6, atol=1e-6)
  assert codes[0].shape == (2, 4, 12, 12)
  rms = np.sqrt(np.mean(np.square(codes[1]), axis=1))
  causal = np.tril(np.ones((12, 12), bool))
  np.testing.assert_allclose(rms[:, causal], 1.0, atol=1e-2)
  assert np.all(np.asarray(codes[1])[:, :, ~causal] == 0)


@pytest.mark.slow
def test_bidirectional_model_sees_the_future():
  m, params, tokens_bt = _model(causal=False, positions="relative_bias")
  logits = m.apply({"params": params}, tokens_bt)
  logits2 = m.apply({"params": params}, tokens_bt.at[:, -1].set((tokens_bt[:, -1] + 1) % 50))
  assert not np.allclose(logits[:, 0], logits2[:, 0])


def test_relative_buckets_follow_t5():
  rel = jnp.arange(-200, 201)
  causal = model_lib.relative_bucket(rel, bidirectional=False, num_buckets=32, max_distance=128)
  assert int(causal[200]) == 0 and int(causal[199]) == 1  # same position; one step back
  assert np.all(np.asarray(causal[201:]) == 0)  # the future shares bucket 0
  assert int(causal[0]) == 31 and np.all(np.diff(np.asarray(causal[:201])) <= 0)
  both = model_lib.relative_bucket(rel, bidirectional=True, num_buckets=32, max_distance=128)
  assert int(both[201]) == 17 and int(both[199]) == 1 and int(both[400]) == 31


def test_rotary_preserves_norms_and_depends_on_relative_offset():
  x = jax.random.normal(jax.random.key(0), (1, 1, 2, 8))
  pos = lambda p: jnp.full((1, 1), p)
  np.testing.assert_allclose(jnp.linalg.norm(model_lib.rotary(x, pos(7), 1e4), axis=-1),
                             jnp.linalg.norm(x, axis=-1), rtol=1e-5)
  dot = lambda a, b: float(
      jnp.sum(model_lib.rotary(x, pos(a), 1e4)[..., 0, :] * model_lib.rotary(x, pos(b), 1e4)[..., 1, :]))
  assert dot(3, 1) == pytest.approx(dot(12, 10), rel=1e-4)


@pytest.mark.slow
def test_rotary_in_bfloat16_stays_within_its_rounding_of_the_float32_rotation():
  # bfloat16 inputs rotate in bfloat16 (sines rounded, products rounded): a few of its units in the last
  # place of the vector's size from the float32 rotation of the same values, never more.
  x = jax.random.normal(jax.random.key(1), (2, 512, 4, 64)).astype(jnp.bfloat16)
  pos = jnp.broadcast_to(jnp.arange(512), (2, 512))
  got = model_lib.rotary(x, pos, 1e4)
  assert got.dtype == jnp.bfloat16
  want = model_lib.rotary(x.astype(jnp.float32), pos, 1e4)
  err = jnp.abs(got.astype(jnp.float32) - want) / jnp.linalg.norm(want, axis=-1, keepdims=True)
  assert 2**-12 < float(jnp.max(err)) < 2**-8


@pytest.mark.slow
def test_rope_by_product_rotates_as_rotary_does():
  # The partner product is rotate_half(x w) as a column permutation: the same function and gradients,
  # projection biases included (perturbed from their zero initialisation so their partners count).
  kw = dict(V=50, D=32, H=4, L=1, F=64, attention="linear", projection_bias=True)
  m, params, tokens_bt = _model(**kw)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(2), len(leaves))
  params = tree.unflatten([p + 0.1 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])
  fused = model_lib.Transformer(model_lib.ModelConfig(**kw, rope_by_product=True))
  (out, grads), (ref, ref_grads) = (_output_and_grads(x, params, tokens_bt) for x in (fused, m))
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  # Gradients sum the two products' parts in another order: float32 rounding of the largest entry.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max()), grads,
               ref_grads)


@pytest.mark.slow
def test_remat_and_bfloat16_keep_the_function():
  m, params, tokens_bt = _model(attention="hyla")
  ref, ref_grads = _output_and_grads(m, params, tokens_bt)
  for remat in ("mlp", "block"):
    recompute = model_lib.Transformer(
        model_lib.ModelConfig(V=50, D=32, H=4, L=2, F=64, attention="hyla", remat=remat))
    out, grads = _output_and_grads(recompute, params, tokens_bt)
    # Recomputation may sum in another order: its error is a few float32 ulps of each array's scale
    # (about 20 here), which an element near 0 gets too.
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * np.abs(b).max()), grads,
                 ref_grads)
  bf16 = model_lib.Transformer(
      model_lib.ModelConfig(V=50, D=32, H=4, L=2, F=64, attention="hyla", dtype="bfloat16"))
  out = bf16.apply({"params": params}, tokens_bt)
  assert out.dtype == jnp.float32 and np.abs(np.asarray(out) - np.asarray(ref)).max() < 0.1
  assert jax.tree.leaves(params)[0].dtype == jnp.float32


_ROUNDING_CASES = {
    "relative_bias": dict(positions="relative_bias", relative_bias_per_layer=True, attention="hyla"),
    "relative_bias_tied": dict(positions="relative_bias", relative_bias_per_layer=True, tied_embeddings=True),
    "rope_by_product": dict(positions="rotary", rope_by_product=True),  # as configs/c4_50m.py
    "learned": dict(positions="learned"),
    "remat_block_tied": dict(positions="rotary", rope_by_product=True, remat="block", tied_embeddings=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(_ROUNDING_CASES))
def test_parameters_rounded_before_use_change_no_number(case):
  """What `rounding.rounded_before_use` reads off the model as used once, rounded, rounded to bfloat16
  before a bfloat16 model gives the same outputs and gradients to the bit: the model rounds them itself.
  It leaves out the relative-position tables (added to float32 scores), a tied embedding (the lookup and
  the readout) and with rope_by_product the q and k projections (each in two products), and rounding
  those too changes numbers: the outputs, the embedding's gradient, the projections' gradients."""
  kw = {
      **dict(V=50, D=32, H=4, L=2, F=64, attention="softmax", dtype="bfloat16", projection_bias=True),
      **_ROUNDING_CASES[case]
  }
  tied, twice = kw.get("tied_embeddings", False), kw.get("rope_by_product", False)
  m, params, tokens_bt = _model(**kw)
  params = nn.meta.unbox(params)
  marked = rounding.rounded_before_use(lambda p, t: jnp.sum(m.apply({"params": p}, t)**2), jnp.bfloat16,
                                       params, tokens_bt)
  for i in range(2):
    attn, mlp = marked[f"block_{i}"]["attn"], marked[f"block_{i}"]["mlp"]
    assert marked["embed"] != tied and attn["wv"] and attn["bo"] and mlp["wi"] and mlp["bi"]
    assert not marked[f"block_{i}"]["ln_attn"]["scale"] and not marked.get(f"relative_bias_{i}", False)
    assert attn["wq"] == attn["wk"] == attn["bq"] == attn["bk"] == (not twice)
  ref, ref_grads = _output_and_grads(m, params, tokens_bt)
  rounded = jax.tree.map(lambda p, r: p.astype(jnp.bfloat16) if r else p, params, marked)
  out, grads = _output_and_grads(m, rounded, tokens_bt)
  np.testing.assert_array_equal(out, ref)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a.astype(jnp.float32), b), grads, ref_grads)
  if case == "learned":
    return
  every_out, every_grads = _output_and_grads(
      m, jax.tree.map(lambda p: p.astype(jnp.bfloat16) if p.ndim >= 2 else p, params), tokens_bt)
  differs = lambda a, b: np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max() > 0
  if case == "relative_bias":
    assert differs(every_out, ref)
  if tied:
    assert differs(every_grads["embed"], ref_grads["embed"])
  if twice:
    attn_grads = [(every_grads[f"block_{i}"]["attn"], ref_grads[f"block_{i}"]["attn"]) for i in range(2)]
    assert any(differs(e[w], r[w]) for e, r in attn_grads for w in ("wq", "wk"))


@pytest.mark.slow
def test_remat_mlp_keeps_no_hidden_for_the_backward_pass(capsys):
  """remat="mlp" saves the MLP's input, not its [B, T, F] hidden (F = 96 is no other dimension here)."""
  saved = {}
  for remat in ("none", "mlp"):
    m, params, tokens_bt = _model(F=96, remat=remat)
    ad_checkpoint.print_saved_residuals(lambda p: jnp.sum(m.apply({"params": p}, tokens_bt)), params)
    saved[remat] = capsys.readouterr().out
  assert "[2,12,96]" in saved["none"] and "[2,12,96]" not in saved["mlp"]


def test_remat_names_what_it_recomputes():
  with pytest.raises(ValueError, match="unknown model.remat 'mpl'; choose one of: none, mlp, block"):
    model_lib.ModelConfig(V=50, remat="mpl")


@pytest.mark.slow
def test_hybrid_layers_compute_what_their_presets_compute():
  """"softmax,hyla" over 2 layers: layer 0 a softmax layer, layer 1 a HYLA layer."""
  assert model_lib.layer_presets("hyla,softmax", 6) == ("hyla", "softmax") * 3
  hybrid = model_lib.ModelConfig(V=50, D=32, H=4, L=2, F=64, attention="softmax,hyla")
  m, params, tokens_bt = _model(L=2, attention="softmax,hyla")
  x_btd = jax.random.normal(jax.random.key(3), (2, 12, 32))
  pos_bt = jnp.broadcast_to(jnp.arange(12), (2, 12))
  for i, (name, other) in enumerate([("softmax", "hyla"), ("hyla", "softmax")]):
    block = lambda cfg: model_lib.Block(cfg, i).apply({"params": params[f"block_{i}"]}, x_btd, pos_bt, None,
                                                      None)
    single = lambda preset: block(dataclasses.replace(hybrid, attention=preset))
    np.testing.assert_allclose(block(hybrid), single(name), rtol=1e-6, atol=1e-6)
    assert not np.allclose(block(hybrid), single(other), atol=1e-3)
  codes = model_lib.latent_codes(m, params, tokens_bt)
  np.testing.assert_allclose(np.sum(codes[0], axis=-1), 1.0, rtol=1e-5)  # softmax: rows sum to 1
  causal = np.tril(np.ones((12, 12), bool))
  np.testing.assert_allclose(np.sqrt(np.mean(np.square(codes[1]), axis=1))[:, causal], 1.0, atol=1e-2)


def test_hybrid_flops_are_the_sum_of_their_layers():
  cfg = lambda attention: model_lib.ModelConfig(V=50, D=32, H=4, L=4, F=64, attention=attention)
  per_token = lambda attention: flops.flops_per_token(cfg(attention), 10_000, 512)
  assert per_token("hyla") > per_token("softmax")
  assert per_token("hyla,softmax") == (per_token("hyla") + per_token("softmax")) / 2
  assert per_token("hyla,hyla,hyla,softmax") == (3 * per_token("hyla") + per_token("softmax")) / 4


@pytest.mark.parametrize("kind,peak", [
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA H200 NVL", 835e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100-SXM4-40GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12),
    ("TPU v5 lite", 197e12),
])
def test_peak_flops_of_gpus_and_tpus_by_the_device_kind_jax_reports(kind, peak):
  """Dense bfloat16 peaks from the vendors' sheets, summed over the devices (the MFU's denominator)."""
  device = lambda: type("Device",
                        (), dict(platform="tpu" if kind.startswith("TPU") else "gpu", device_kind=kind))()
  assert flops.peak_flops([device()]) == peak
  assert flops.peak_flops([device() for _ in range(8)]) == 8 * peak


def test_peak_flops_of_an_unknown_gpu_is_none():
  device = type("Device", (), dict(platform="gpu", device_kind="NVIDIA GeForce RTX 3090"))()
  assert flops.peak_flops([device]) is None


def _products(jaxpr):
  """Every matrix product (dot_general) in a jaxpr, into nested calls."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      yield eqn
    for sub in jax_core.jaxprs_in_params(eqn.params):
      yield from _products(sub)


def _matmul_flops(jaxpr) -> int:
  """2 x the multiply-adds of every matrix product in a jaxpr, into nested calls."""
  total = 0
  for eqn in _products(jaxpr):
    (contract, _), _ = eqn.params["dimension_numbers"]
    total += 2 * np.prod(eqn.outvars[0].aval.shape) * np.prod([eqn.invars[0].aval.shape[a] for a in contract])
  return total


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["softmax", "hyla"])
def test_flops_of_a_model_that_reads_the_last_positions(preset):
  """What flops_per_token takes off for readout_last is what the trimmed forward pass stops
  multiplying (x3 for training), counted from the model's matrix products."""
  cfg = model_lib.ModelConfig(V=8, D=32, H=4, L=3, F=48, qkv_dim=16, input_dim=8, causal=False,
                              attention=preset, attention_impl="reference", positions="none")
  B, T, n = 2, 12, 4
  x_btd = jnp.ones((B, T, cfg.input_dim))
  model = model_lib.Transformer(cfg)
  params = model.init(jax.random.key(0), x_btd)
  forward = lambda last: _matmul_flops(
      jax.make_jaxpr(lambda p: model.apply(p, x_btd, readout_last=last))(params).jaxpr)
  num_params = model_lib.count_params(params)
  saved = flops.flops_per_token(cfg, num_params, T) - flops.flops_per_token(cfg, num_params, T,
                                                                            readout_last=n)
  assert saved > 0
  np.testing.assert_allclose(saved * B * T, 3 * (forward(0) - forward(n)), rtol=1e-9)


@pytest.mark.parametrize("attention,message", [
    ("hyla,softmax,linear", "pattern of 3 layers, which does not divide model.L=4"),
    ("hyla,hyla2", "unknown attention 'hyla2'"),
])
def test_bad_hybrid_fails_with_a_clear_message(attention, message):
  with pytest.raises(ValueError, match=message):
    model_lib.ModelConfig(V=8, L=4, attention=attention)


def test_checkpoint_compatibility_compares_layers():
  saved = {"model": {"attention": "hyla,softmax", "L": 4}}
  checkpointing.check_compatible(saved, {"model": {"attention": "hyla,softmax,hyla,softmax", "L": 4}})
  with pytest.raises(ValueError,
                     match="model.attention: checkpoint has 'hyla,softmax', config has 'softmax,hyla'"):
    checkpointing.check_compatible(saved, {"model": {"attention": "softmax,hyla", "L": 4}})


@pytest.mark.slow
@pytest.mark.parametrize("name,kw", [
    ("softmax",
     dict(causal=False, positions="relative_bias", relative_bias_per_layer=True, relative_bidirectional=False,
          relative_buckets=12, relative_max_distance=12)),
    ("hyla", dict(causal=False, positions="relative_bias", relative_buckets=12, relative_max_distance=12)),
    ("hyla", dict(positions="rotary", remat="block")),
    ("linear", dict(positions="learned")),
])
def test_readout_last_is_the_full_models_last_rows_with_dropout_and_gradients(name, kw):
  """The compositional tasks read the last positions only; the model then forms only those in its last
  layer. Outputs and every parameter's gradient must be the full model's, dropout included."""
  m, params, tokens_bt = _model(attention=name, attention_dropout=0.3, **kw)
  run = lambda p, n: m.apply({"params": p}, tokens_bt, deterministic=False, rngs=
                             {"dropout": jax.random.key(7)}, readout_last=n)
  # Compiled, not op by op: eagerly these few small products take half a minute.
  run = jax.jit(run, static_argnums=1)
  full, last = run(params, 0), run(params, 4)
  assert last.shape == (2, 4, 50)
  np.testing.assert_allclose(last, full[:, -4:], rtol=1e-5, atol=1e-6)
  deterministic = jax.jit(lambda p, n: m.apply({"params": p}, tokens_bt, readout_last=n), static_argnums=1)
  np.testing.assert_allclose(deterministic(params, 1), deterministic(params, 0)[:, -1:], rtol=1e-5, atol=1e-6)
  weights_v = jnp.arange(50.0) / 50
  grads = [
      jax.jit(jax.grad(lambda p, n=n, s=s: jnp.sum(jnp.tanh(run(p, n)[:, s:]) * weights_v)))(params)
      for n, s in ((0, -4), (4, 0))
  ]
  # HYLA's gradients follow the summation order (relu at z near 0): the full model's two implementations
  # (blocked, reference) differ by up to 3e-3 relative here, the trimmed model from the full by 4e-4.
  # That order's error is relative to a gradient's scale, not to each element: an element near 0 gets
  # the same absolute error as the largest.
  rtol = 1e-3 if name == "hyla" else 1e-4
  jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=max(1e-6,
                                                                        rtol * np.abs(b).max())), *grads)
  assert float(jnp.abs(jax.tree.leaves(grads[1]["block_1"]["attn"]["wq"])[0]).max()) > 0


def test_readout_last_refuses_what_it_cannot_keep_exact():
  m, params, tokens_bt = _model()
  for kw in (dict(segment_ids_bt=jnp.ones_like(tokens_bt)), dict(readout_last=13)):
    with pytest.raises(ValueError, match="readout_last"):
      m.apply({"params": params}, tokens_bt, **{"readout_last": 2, **kw})


def test_bfloat16_products_round_the_operands_and_nothing_else():
  """model.matmul_dtype="bfloat16": each dense product, forward and backward, multiplies bfloat16
  operands into a float32 result; the result is the float32 product of the rounded operands."""
  cfg = model_lib.ModelConfig(V=50, matmul_dtype="bfloat16")
  x_btd, w_dhk, g_bthk = (
      jax.random.normal(jax.random.key(i), s) for i, s in enumerate([(2, 5, 8), (8, 3, 4), (2, 5, 3, 4)]))
  rounded = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)
  spec = "btd,dhk->bthk"
  out, pull = jax.vjp(lambda x, w: model_lib.product(cfg, spec, x, w), x_btd, w_dhk)
  dx, dw = pull(g_bthk)
  assert out.dtype == dx.dtype == dw.dtype == jnp.float32
  exact = lambda s, a, b: jnp.einsum(s, rounded(a), rounded(b), precision="highest")
  np.testing.assert_allclose(out, exact(spec, x_btd, w_dhk), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(dx, exact("bthk,dhk->btd", g_bthk, w_dhk), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(dw, exact("btd,bthk->dhk", x_btd, g_bthk), rtol=1e-6, atol=1e-6)
  assert not np.allclose(out, jnp.einsum(spec, x_btd, w_dhk, precision="highest"), rtol=1e-6, atol=1e-6)
  jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(model_lib.product(cfg, spec, x, w)**2),
                                  argnums=(0, 1)))(x_btd, w_dhk)
  dots = list(_products(jaxpr.jaxpr))
  assert len(dots) == 3
  assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
  assert all(e.outvars[0].aval.dtype == jnp.float32 for e in dots)


@pytest.mark.slow
def test_bfloat16_products_stay_closer_to_float32_than_bfloat16_compute():
  """Rounding only the products' operands: outputs and every parameter's gradient are nearer the
  float32 model's than those of model.dtype="bfloat16" (which rounds everything), and float32."""
  m, params, tokens_bt = _model(attention="hyla")
  ref, ref_grads = _output_and_grads(m, params, tokens_bt)
  errors = {}
  for kw in (dict(matmul_dtype="bfloat16"), dict(dtype="bfloat16")):
    out, grads = _output_and_grads(model_lib.Transformer(dataclasses.replace(m.cfg, **kw)), params, tokens_bt)
    assert out.dtype == jnp.float32 and all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    relative = jax.tree.map(lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)), grads, ref_grads)
    errors[kw.popitem()[0]] = (float(jnp.abs(out - ref).max()), max(jax.tree.leaves(relative)))
  assert 0 < errors["matmul_dtype"][0] < errors["dtype"][0] < 0.1
  assert 0 < errors["matmul_dtype"][1] < errors["dtype"][1] < 0.3


@pytest.mark.parametrize("kw, message", [
    (dict(matmul_dtype="fp8"),
     "unknown model.matmul_dtype 'fp8'; choose '' .model.dtype. or one of: float32, bfloat16"),
    (dict(matmul_dtype="float32",
          dtype="bfloat16"), "model.matmul_dtype='float32' needs model.dtype='float32'"),
])
def test_bad_matmul_dtype_fails_with_a_clear_message(kw, message):
  with pytest.raises(ValueError, match=message):
    model_lib.ModelConfig(V=50, **kw)
