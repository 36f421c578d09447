"""The hypernetwork value network (HYLA and its rms_head / none ablations) in Pallas TPU kernels that
keep every tile's value-network tensors on chip.

XLA's form of the blocked kernel (attention_blocked.py) writes each tile's [rows, queries, keys, d]
tensors (z, φ(z), their gradients) to HBM between its fusions: about 33 passes over a tile's z per
training step on a v5e chip, four times softmax's whole step for configs/c4_50m.py
(docs/compile_table.md). Here a tile's z lives in VMEM only, and HBM sees q, k, v, the output and
their gradients, as for flash attention.

One tile is BLOCK_Q queries by BLOCK_K keys, keys on the lanes: the scores s_h [BQ, BK] of each head
come from the MXU; the pair's weights a_h from the normalisation (core.normalize, and its pullback by
autodiff); z [BQ, d, BK] = Σ_h a_h[:, None, :] · vᵀ_h[None] on the vector unit, v passed transposed
([d, keys]) so that a head's values broadcast over the query axis for free; the output's sum over keys
is a reduction over lanes. With 8 heads of 64 the value network's products contract over, or stack, 8
heads: shapes that would fill 8 of the MXU's 128 rows, so they stay on the vector unit.

The forward kernel's grid steps hold 128 queries (BLOCK_Q_FORWARD) and walk them in tiles of 32, so
that a key block is read from HBM once per 128 queries while a tile's z stays 1 MB.

The backward pass is one kernel that walks query blocks for each key block, recomputes each tile, and
accumulates dk and dv on chip; each tile's share of dq goes to a partial per key block (float32, summed
by XLA), since two kernels in flash attention's split would each redo the tile's vector work, which is
most of the time (`vector_ops`). Causal tiles wholly above the diagonal are
neither computed nor fetched.
No bias, no dropout: lm/attention.py's table sends those calls to the blocked kernel.
"""

import dataclasses
import functools
import math
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.extend import core as jax_core

from lm import attention_core as core

# A tile's float32 [BQ, d, BK] arrays (z, φ(z), dp, dz) are 1 MB each at d = 64; the backward kernel
# holds several beside its blocks, so the scoped VMEM limit is raised from 16 MB (a v5e chip has 128 MiB).
BLOCK_Q, BLOCK_K = 32, 128
# The forward kernel's grid steps take this many queries, walked in tiles of BLOCK_Q: each key block is
# then read once per 128 queries, not per 32 (a quarter of the forward's HBM traffic for k and v).
# BLOCK_K is a multiple of it, so every tile of a causally visible step is visible too.
BLOCK_Q_FORWARD = 128
_FORWARD, _BACKWARD = "hypernetwork_fwd", "hypernetwork_bwd"  # the kernels' pallas_call names
# Each kernel's queries per grid step, by its name.
_GRID_QUERY_BLOCK = {_FORWARD: BLOCK_Q_FORWARD, _BACKWARD: BLOCK_Q}
VMEM_LIMIT = 32 * 2**20


def attend_pallas_hypernetwork(q: jax.Array, k: jax.Array, v: jax.Array, *, knobs: core.Knobs,
                               causal: bool = True, segment_ids: jax.Array | None = None,
                               batch_axes: tuple[str, ...] = (), interpret: bool = False) -> jax.Array:
  """attention_core.reference's contract for the hypernetwork value network with rms_head or none
  normalisation, lengths a multiple of BLOCK_K, on each device's shard. interpret: Pallas's
  interpreter (any backend)."""
  local = lambda q, k, v, seg, _: _attend(q, k, v, seg, knobs=knobs, causal=causal, interpret=interpret)
  return core.per_device(local, q, k, v, segment_ids, None, batch_axes, split_heads=False)


def _attend(q, k, v, segment_ids, *, knobs, causal, interpret):
  # Kernel layout: heads before positions; v transposed so that keys are the minor (lane) axis.
  q_bhtd, k_bhtd = (jnp.swapaxes(x, 1, 2) for x in (q, k))
  vt_bhdt = jnp.transpose(v, (0, 2, 3, 1))
  seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
  static = _Static(knobs, causal, interpret)
  return jnp.swapaxes(_core(static, q_bhtd, k_bhtd, vt_bhdt, seg), 1, 2)


@dataclasses.dataclass(frozen=True)
class _Static:
  """The static part of a call: what the kernels are built from."""
  knobs: core.Knobs
  causal: bool
  interpret: bool


def _visible(causal: bool, i, j, bq: int, bk: int):
  """Whether query block i sees any key of key block j."""
  return True if not causal else j * bk <= i * bq + bq - 1


def _last_key_block(causal: bool, i, j, bq: int, bk: int):
  """The key block to fetch at grid step (i, j): past the diagonal, the last one i sees, so that Pallas
  (which skips a fetch of the block it already holds) reads nothing for the skipped tiles. (lax.div:
  Mosaic lowers `//` through sign, which asks the TPU's generation of the host compiling.)"""
  return jnp.minimum(j, jax.lax.div(i * bq + bq - 1, bk)) if causal else j


def _first_query_block(causal: bool, i, j, bq: int, bk: int):
  """The query block to fetch at grid step (key block j, query block i): before the diagonal, the
  first one that sees key block j."""
  return jnp.maximum(i, jax.lax.div(j * bk, bq)) if causal else i


def _sum_heads(terms: list[jax.Array]) -> jax.Array:
  """Σ of the heads' [BQ, d, BK] terms from the first (Python's sum would add the first to 0: one
  more pass over the tile on the vector unit)."""
  return functools.reduce(operator.add, terms)


def _tile(static: _Static, q0, k0, q_hqd, k_ref, vt_ref, segq_q1, segk_1k):
  """The tile of queries q_hqd [H, BQ, d] from position q0 and the key block from k0, up to z: the mask
  [BQ, BK] (or None), the normalisation's pullback, the weights a [1, H, BQ, BK], vᵀ [H, d, BK] and z
  [BQ, d, BK], all float32. segq_q1 [BQ, 1] and segk_1k [1, BK]: segment ids, or None."""
  H, bq, d = q_hqd.shape
  bk = k_ref.shape[2]
  mask = None
  if static.causal:
    q_pos = q0 + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    k_pos = k0 + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    mask = q_pos >= k_pos
  if segq_q1 is not None:
    same = segq_q1 == segk_1k
    mask = same if mask is None else mask & same
  contract_d = (((1,), (1,)), ((), ()))
  s_1hqk = jnp.stack([
      jax.lax.dot_general(q_hqd[h], k_ref[0, h], contract_d, preferred_element_type=jnp.float32)
      for h in range(H)
  ])[None] * d**-0.5
  mask_11qk = None if mask is None else mask[None, None]
  if mask_11qk is not None:
    s_1hqk = jnp.where(mask_11qk, s_1hqk, 0.0)
  a_1hqk, normalize_pullback = jax.vjp(
      lambda s: core.normalize(s, mask_11qk, normalization=static.knobs.normalization), s_1hqk)
  vt_hdk = vt_ref[0].astype(jnp.float32)
  z_qdk = _sum_heads([a_1hqk[0, h][:, None, :] * vt_hdk[h][None] for h in range(H)])
  return mask_11qk, normalize_pullback, a_1hqk, vt_hdk, z_qdk


def _tile_grads(static: _Static, q0, k0, q_ref, k_ref, vt_ref, g_ref, segq_ref, segk_ref):
  """The tile's weights a [1, H, BQ, BK], the cotangent ds [1, H, BQ, BK] of the scaled scores (the
  caller applies 1/sqrt(d) for dq and dk) and dz [BQ, d, BK], given the output's cotangent g [H, BQ, d]."""
  H = q_ref.shape[1]
  segq_q1, segk_1k = (None, None) if segq_ref is None else (segq_ref[0], segk_ref[0])
  mask_11qk, normalize_pullback, a_1hqk, vt_hdk, z_qdk = _tile(static, q0, k0, q_ref[0], k_ref, vt_ref,
                                                               segq_q1, segk_1k)
  p_qdk, phi_pullback = jax.vjp(core.NONLINEARITIES[static.knobs.nonlinearity], z_qdk)
  g_hqd = g_ref[0].astype(jnp.float32)
  g_hqd1 = [g_hqd[h][:, :, None] for h in range(H)]
  dz_qdk = phi_pullback(_sum_heads([a_1hqk[0, h][:, None, :] * g_hqd1[h] for h in range(H)]))[0]
  # a_h's cotangent: through the output (Σ_d g_h · φ(z)) and through z (Σ_d dz · v_h).
  da_1hqk = jnp.stack([(g_hqd1[h] * p_qdk + dz_qdk * vt_hdk[h][None]).sum(1) for h in range(H)])[None]
  ds_1hqk = normalize_pullback(da_1hqk)[0]
  if mask_11qk is not None:
    ds_1hqk = jnp.where(mask_11qk, ds_1hqk, 0.0)
  return a_1hqk, ds_1hqk, dz_qdk


def _forward_kernel(*refs, static, segments):
  q_ref, k_ref, vt_ref = refs[:3]
  segq_ref, segk_ref = refs[3:5] if segments else (None, None)
  out_ref, acc_ref = refs[-2:]
  i, j = pl.program_id(1), pl.program_id(2)
  _, H, bqf, _ = q_ref.shape
  bk = k_ref.shape[2]

  @pl.when(j == 0)
  def _():
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(_visible(static.causal, i, j, bqf, bk))
  def _():
    for t in range(bqf // BLOCK_Q):
      rows = slice(t * BLOCK_Q, (t + 1) * BLOCK_Q)
      segq_q1, segk_1k = (None, None) if segq_ref is None else (segq_ref[0, rows], segk_ref[0])
      _, _, a_1hqk, _, z_qdk = _tile(static, i * bqf + t * BLOCK_Q, j * bk, q_ref[0, :, rows], k_ref, vt_ref,
                                     segq_q1, segk_1k)
      p_qdk = core.NONLINEARITIES[static.knobs.nonlinearity](z_qdk)
      for h in range(H):
        acc_ref[h, rows] += (a_1hqk[0, h][:, None, :] * p_qdk).sum(-1)

  @pl.when(j == pl.num_programs(2) - 1)
  def _():
    out_ref[0] = acc_ref[...].astype(out_ref.dtype)


def _backward_kernel(*refs, static, segments):
  """dk and dv accumulated over the query blocks of key block j; each tile's share of dq written to
  its own block of the [key blocks, ...] partials (zeros where the tile is not visible)."""
  q_ref, k_ref, vt_ref, g_ref = refs[:4]
  segq_ref, segk_ref = refs[4:6] if segments else (None, None)
  dq_ref, dk_ref, dvt_ref, dk_acc_ref, dvt_acc_ref = refs[-5:]
  j, i = pl.program_id(1), pl.program_id(2)
  _, H, bq, d = q_ref.shape
  bk = k_ref.shape[2]
  visible = _visible(static.causal, i, j, bq, bk)

  @pl.when(i == 0)
  def _():
    dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)
    dvt_acc_ref[...] = jnp.zeros(dvt_acc_ref.shape, jnp.float32)

  @pl.when(visible)
  def _():
    a_1hqk, ds_1hqk, dz_qdk = _tile_grads(static, i * bq, j * bk, q_ref, k_ref, vt_ref, g_ref, segq_ref,
                                          segk_ref)
    contract_q = (((0,), (0,)), ((), ()))
    for h in range(H):
      ds_qk = ds_1hqk[0, h].astype(q_ref.dtype)
      dq_ref[0, 0, h] = jnp.dot(ds_qk, k_ref[0, h], preferred_element_type=jnp.float32) * d**-0.5
      dk_acc_ref[h] += jax.lax.dot_general(ds_qk, q_ref[0, h], contract_q,
                                           preferred_element_type=jnp.float32) * d**-0.5
      dvt_acc_ref[h] += (a_1hqk[0, h][:, None, :] * dz_qdk).sum(0)

  @pl.when(jnp.logical_not(visible))
  def _():
    dq_ref[...] = jnp.zeros(dq_ref.shape, jnp.float32)

  @pl.when(i == pl.num_programs(2) - 1)
  def _():
    dk_ref[0] = dk_acc_ref[...].astype(dk_ref.dtype)
    dvt_ref[0] = dvt_acc_ref[...].astype(dvt_ref.dtype)


def _specs(static: _Static, shape, segments: bool, *, bq: int, keys_outer: bool, with_g: bool):
  """Block specs of (q, k, vᵀ[, g][, query segments, key segments]) for a grid (b, outer, inner) over
  blocks of bq queries and BLOCK_K keys: outer query blocks and inner key blocks, or (keys_outer) the
  other way round."""
  _, H, _, d = shape
  bk, causal = BLOCK_K, static.causal
  if keys_outer:
    qi = lambda j, i: _first_query_block(causal, i, j, bq, bk)
    ij = lambda o, n: (qi(o, n), o)
  else:
    ij = lambda o, n: (o, _last_key_block(causal, o, n, bq, bk))
  query = pl.BlockSpec((1, H, bq, d), lambda b, o, n: (b, 0, ij(o, n)[0], 0))
  specs = [
      query,
      pl.BlockSpec((1, H, bk, d), lambda b, o, n: (b, 0, ij(o, n)[1], 0)),
      pl.BlockSpec((1, H, d, bk), lambda b, o, n: (b, 0, 0, ij(o, n)[1])),
  ]
  if with_g:
    specs.append(query)
  if segments:
    specs += [
        pl.BlockSpec((1, bq, 1), lambda b, o, n: (b, ij(o, n)[0], 0)),
        pl.BlockSpec((1, 1, bk), lambda b, o, n: (b, 0, ij(o, n)[1])),
    ]
  return specs


def _segment_args(seg_bt):
  return () if seg_bt is None else (seg_bt[:, :, None], seg_bt[:, None, :])


def visible_tiles(T: int, causal: bool, bq: int = BLOCK_Q) -> int:
  """How many blocks of bq queries by BLOCK_K keys a kernel's grid computes per batch row, in either
  order of its loops."""
  return sum(bool(_visible(causal, i, j, bq, BLOCK_K)) for i in range(T // bq) for j in range(T // BLOCK_K))


def _cost(static: _Static, shape, itemsize: int, *, bq: int, products: int, keys_outer: bool,
          outer_arrays: int, inner_arrays: int) -> pl.CostEstimate:
  """A kernel's work for XLA's scheduler: `products` multiply-adds of H x d per pair of every visible
  block of bq queries (the score on the MXU, the value network's products on the vector unit), and
  its HBM traffic: `outer_arrays` [B, H, T, d] arrays read or written once, `inner_arrays` read once
  per visible block."""
  B, H, T, d = shape
  tiles = visible_tiles(T, static.causal, bq)
  row = H * d * itemsize
  inner = bq if keys_outer else BLOCK_K
  return pl.CostEstimate(
      flops=2 * B * tiles * bq * BLOCK_K * H * d * products,
      transcendentals=B * tiles * bq * BLOCK_K * (static.knobs.normalization == "rms_head"),
      bytes_accessed=B * row * (outer_arrays * T + inner_arrays * tiles * inner))


# Primitives that move data, index, or run on the MXU: not the vector unit's arithmetic.
_NOT_VECTOR_WORK = frozenset({
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "slice", "dynamic_slice", "concatenate", "get",
    "swap", "program_id", "num_programs", "convert_element_type", "dot_general", "iota", "transpose"
})


def _tile_vector_ops(jaxpr) -> int:
  """Float32 element operations in a kernel body's program, into nested calls; a conditional counts its
  largest branch (for these kernels, the visible tile's work)."""
  ops = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "cond":
      ops += max(_tile_vector_ops(branch.jaxpr) for branch in eqn.params["branches"])
    elif subprograms := list(jax_core.jaxprs_in_params(eqn.params)):  # a jitted or custom-derivative function
      ops += sum(_tile_vector_ops(sub) for sub in subprograms)
    elif name.startswith("reduce_"):
      ops += math.prod(eqn.invars[0].aval.shape)
    elif name not in _NOT_VECTOR_WORK:
      ops += sum(math.prod(v.aval.shape) for v in eqn.outvars)
  return ops


@functools.cache
def vector_ops(knobs: core.Knobs, shape: tuple[int, int, int, int], causal: bool = True) -> dict[str, int]:
  """The kernels' vector-unit work for one forward and backward pass over q, k, v of `shape` [B, T, H, d]:
  float32 element operations per kernel, each kernel's tile body counted from its program times the
  tiles its grid computes. The compiler reports no time for a Pallas kernel (lm-compile divides these
  by the chip's vector rate); matrix products, data movement and masks of packed segments are left out."""
  B, T = shape[:2]
  x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)

  def loss(q, k, v):
    return attend_pallas_hypernetwork(q, k, v, knobs=knobs, causal=causal).astype(jnp.float32).sum()

  program = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, x, x).jaxpr
  return {
      eqn.params["name"]:
          B * visible_tiles(T, causal, _GRID_QUERY_BLOCK[eqn.params["name"]]) *
          _tile_vector_ops(eqn.params["jaxpr"]) for eqn in _pallas_calls(program)
  }


def _pallas_calls(jaxpr):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      yield eqn
    else:
      for sub in jax_core.jaxprs_in_params(eqn.params):
        yield from _pallas_calls(sub)


def _params(static: _Static):
  return dict(
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                           vmem_limit_bytes=VMEM_LIMIT), interpret=static.interpret)


def _check(shape):
  T = shape[2]
  if T % BLOCK_K:
    raise ValueError(f"the hypernetwork kernel tiles sequences in blocks of {BLOCK_K}, got length {T}; "
                     f"use a multiple of {BLOCK_K} or impl 'auto'")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(static, q_bhtd, k_bhtd, vt_bhdt, seg_bt):
  return _core_fwd(static, q_bhtd, k_bhtd, vt_bhdt, seg_bt)[0]


def _core_fwd(static, q_bhtd, k_bhtd, vt_bhdt, seg_bt):
  _check(q_bhtd.shape)
  B, H, T, d = q_bhtd.shape
  segments = seg_bt is not None
  out = pl.pallas_call(
      functools.partial(_forward_kernel, static=static, segments=segments),
      grid=(B, T // BLOCK_Q_FORWARD, T // BLOCK_K),
      in_specs=_specs(static, q_bhtd.shape, segments, bq=BLOCK_Q_FORWARD, keys_outer=False, with_g=False),
      out_specs=pl.BlockSpec((1, H, BLOCK_Q_FORWARD, d), lambda b, i, j: (b, 0, i, 0)),
      out_shape=jax.ShapeDtypeStruct(q_bhtd.shape, q_bhtd.dtype),
      scratch_shapes=[pltpu.VMEM((H, BLOCK_Q_FORWARD, d), jnp.float32)],
      cost_estimate=_cost(static, q_bhtd.shape, q_bhtd.dtype.itemsize, bq=BLOCK_Q_FORWARD, products=3,
                          keys_outer=False, outer_arrays=2, inner_arrays=2),
      name=_FORWARD,
      **_params(static),
  )(q_bhtd, k_bhtd, vt_bhdt, *_segment_args(seg_bt))
  return out, (q_bhtd, k_bhtd, vt_bhdt, seg_bt)


def _core_bwd(static, residuals, g_bhtd):
  q_bhtd, k_bhtd, vt_bhdt, seg_bt = residuals
  B, H, T, d = q_bhtd.shape
  segments = seg_bt is not None
  args = (q_bhtd, k_bhtd, vt_bhdt, g_bhtd.astype(q_bhtd.dtype), *_segment_args(seg_bt))
  # One pass over the tiles for all three gradients (the tiles' vector work is most of the kernel's
  # time); dq's share from each key block goes to its own partial, summed here.
  nk = T // BLOCK_K
  dq_partials, dk, dvt = pl.pallas_call(
      functools.partial(_backward_kernel, static=static, segments=segments),
      grid=(B, nk, T // BLOCK_Q),
      in_specs=_specs(static, q_bhtd.shape, segments, bq=BLOCK_Q, keys_outer=True, with_g=True),
      out_specs=[
          pl.BlockSpec((1, 1, H, BLOCK_Q, d), lambda b, j, i: (j, b, 0, i, 0)),
          pl.BlockSpec((1, H, BLOCK_K, d), lambda b, j, i: (b, 0, j, 0)),
          pl.BlockSpec((1, H, d, BLOCK_K), lambda b, j, i: (b, 0, 0, j)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((nk,) + q_bhtd.shape, jnp.float32),
          jax.ShapeDtypeStruct(k_bhtd.shape, k_bhtd.dtype),
          jax.ShapeDtypeStruct(vt_bhdt.shape, vt_bhdt.dtype)
      ],
      scratch_shapes=[pltpu.VMEM((H, BLOCK_K, d), jnp.float32),
                      pltpu.VMEM((H, d, BLOCK_K), jnp.float32)],
      cost_estimate=_cost(static, q_bhtd.shape, q_bhtd.dtype.itemsize, bq=BLOCK_Q, products=8,
                          keys_outer=True, outer_arrays=4 + 2 * nk, inner_arrays=2),
      name=_BACKWARD,
      **_params(static),
  )(*args)
  dq = dq_partials.sum(0).astype(q_bhtd.dtype)
  return dq, dk, dvt, None


_core.defvjp(_core_fwd, _core_bwd)
