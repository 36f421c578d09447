"""Linear attention (normalization none, value network linear): out_q = Σ_{k visible, same segment}
(q·k / sqrt(d)) v_k, two ways.

attend_chunked, causal, in O(t·d²) work: within a chunk of C tokens the masked [C, C] scores are used
directly; across chunks, a running state S = Σ_k k vᵀ ([heads, d, d]) carries everything before the
chunk. Segments reset the state: a chunk's state keeps only keys of its last token's segment, and a
query reads the state only when it belongs to that segment. Segment ids must therefore be contiguous
runs (as packing produces), which is what a causal packed batch is.

attend_pallas_linear, Pallas TPU kernels, quadratic as flash attention is: each tile's masked scores
[BQ, BK] stay on chip between the MXU products that use them, and HBM sees q, k, v, the output and
their gradients only. Either direction, any segment ids; no bias, no dropout. `auto` runs them on TPU,
where XLA writes the chunks' scores and states to HBM between its fusions, and these kernels move less
than half of that traffic for configs/c4_50m.py (docs/results/compile_v5e.md).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lm.attention import core

CHUNK = 64
# The kernels' square blocks: the largest of these that divides the length (fewer grid steps, each
# with more work for the MXU; causal blocks on the diagonal are computed whole).
BLOCKS = (512, 256, 128)
FORWARD, BACKWARD = "linear_attention_fwd", "linear_attention_bwd"  # the kernels' pallas_call names
VMEM_LIMIT = 32 * 2**20
# The backward kernel keeps a row's dq in float32 on chip, [T, d] padded to 128 lanes per head: this
# much reaches 65,536 tokens.
DQ_ACC_LIMIT = 32 * 2**20


def attend_chunked(q: jax.Array, k: jax.Array, v: jax.Array, *, segment_ids: jax.Array | None = None,
                   chunk: int = CHUNK) -> jax.Array:
  """core.reference's contract with normalization none, value network linear, causal, no
  bias and no dropout (lm/attention/__init__.py's table holds these limits)."""
  B, T, H, K = q.shape
  C = min(chunk, T)
  N = -(-T // C)
  seg_bt = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  # Padding goes after every real token, so causality already hides it from them.
  pad = ((0, 0), (0, N * C - T), (0, 0), (0, 0))
  q_bnchd, k_bnchd, v_bnchd = (jnp.pad(x, pad).reshape(B, N, C, H, K) for x in (q, k, v))
  seg_bnc = jnp.pad(seg_bt, ((0, 0), (0, N * C - T)), constant_values=-1).reshape(B, N, C)
  q_bnchd = q_bnchd * K**-0.5
  f32 = dict(preferred_element_type=jnp.float32)

  causal_qk = jnp.tril(jnp.ones((C, C), bool))
  same_bnqk = seg_bnc[:, :, :, None] == seg_bnc[:, :, None, :]
  s_bnhqk = jnp.einsum("bnqhd,bnkhd->bnhqk", q_bnchd, k_bnchd, **f32)
  s_bnhqk = jnp.where((causal_qk & same_bnqk)[:, :, None], s_bnhqk, 0.0)
  intra_bnqhd = jnp.einsum("bnhqk,bnkhd->bnqhd", s_bnhqk.astype(v.dtype), v_bnchd, **f32)

  last_bn = seg_bnc[:, :, -1]
  keep_bnc = seg_bnc == last_bn[:, :, None]
  kv_bnhde = jnp.einsum("bnkhd,bnkhe->bnhde", jnp.where(keep_bnc[..., None, None], k_bnchd, 0), v_bnchd,
                        **f32)
  prev_bn = jnp.pad(last_bn[:, :-1], ((0, 0), (1, 0)), constant_values=-2)
  reset_bn = last_bn != prev_bn

  def combine(earlier, later):
    reset_e, s_e = earlier
    reset_l, s_l = later
    return reset_e | reset_l, jnp.where(reset_l[..., None, None, None], s_l, s_e + s_l)

  _, state_bnhde = jax.lax.associative_scan(combine, (reset_bn, kv_bnhde), axis=1)
  # Chunk n reads the state after chunk n-1, if the query is in that chunk's last segment.
  state_bnhde = jnp.pad(state_bnhde[:, :-1], ((0, 0), (1, 0), (0, 0), (0, 0), (0, 0)))
  reads_bnc = seg_bnc == prev_bn[:, :, None]
  inter_bnqhd = jnp.einsum("bnqhd,bnhde->bnqhe", jnp.where(reads_bnc[..., None, None], q_bnchd, 0),
                           state_bnhde.astype(q.dtype), **f32)
  return (intra_bnqhd + inter_bnqhd).reshape(B, N * C, H, K)[:, :T].astype(q.dtype)


def block(T: int) -> int:
  """The kernels' block for length T (a multiple of 128)."""
  return next(b for b in BLOCKS if T % b == 0)


def visible_tiles(T: int, causal: bool) -> int:
  """How many tiles (grid steps) either kernel computes per batch row and head."""
  return core.visible_blocks(T, block(T), block(T), causal)


def attend_pallas_linear(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                         segment_ids: jax.Array | None = None, batch_axes: tuple[str, ...] = (),
                         interpret: bool = False) -> jax.Array:
  """core.reference's contract with normalization none and value network linear, lengths a
  multiple of 128, on each device's shard (heads are independent: they split over a tensor axis).
  interpret: Pallas's interpreter (any backend)."""

  def local(q, k, v, seg, _):
    q_bhtd, k_bhtd, v_bhtd = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    seg = None if seg is None else seg.astype(jnp.int32)
    return jnp.swapaxes(_core(causal, interpret, q_bhtd, k_bhtd, v_bhtd, seg), 1, 2)

  return core.per_device(local, q, k, v, segment_ids, None, batch_axes)


def _scores(causal: bool, q0, k0, q_ref, k_ref, segq_ref, segk_ref):
  """The tile's masked scores [BQ, BK] in float32, and its mask (or None)."""
  q_qd, k_kd = q_ref[0, 0], k_ref[0, 0]
  bq, d = q_qd.shape
  segq_q1, segk_1k = (None, None) if segq_ref is None else (segq_ref[0], segk_ref[0])
  mask = core.tile_mask(causal, q0, k0, bq, k_kd.shape[0], segq_q1, segk_1k)
  s_qk = jax.lax.dot_general(q_qd, k_kd,
                             (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * d**-0.5
  return (s_qk if mask is None else jnp.where(mask, s_qk, 0.0)), mask


def _forward_kernel(*refs, causal, segments):
  q_ref, k_ref, v_ref = refs[:3]
  segq_ref, segk_ref = refs[3:5] if segments else (None, None)
  out_ref, acc_ref = refs[-2:]
  i, j = pl.program_id(2), pl.program_id(3)
  bq, bk = q_ref.shape[2], k_ref.shape[2]

  @pl.when(j == 0)
  def _():
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(core.block_visible(causal, i, j, bq, bk))
  def _():
    s_qk, _ = _scores(causal, i * bq, j * bk, q_ref, k_ref, segq_ref, segk_ref)
    acc_ref[...] += jnp.dot(s_qk.astype(v_ref.dtype), v_ref[0, 0], preferred_element_type=jnp.float32)

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    out_ref[0, 0] = acc_ref[...].astype(out_ref.dtype)


def _backward_kernel(*refs, causal, segments):
  """dk and dv accumulated over the query blocks of key block j, dq over the key blocks of the row
  (dq_acc [query blocks, BQ, d]) and written at the last key block, as hypernetwork.py's
  backward kernel does: one pass over the tiles for all three."""
  q_ref, k_ref, v_ref, g_ref = refs[:4]
  segq_ref, segk_ref = refs[4:6] if segments else (None, None)
  dq_ref, dk_ref, dv_ref, dq_acc_ref, dk_acc_ref, dv_acc_ref = refs[-6:]
  j, i = pl.program_id(2), pl.program_id(3)
  bq, d = q_ref.shape[2:]
  bk = k_ref.shape[2]
  contract_rows = (((0,), (0,)), ((), ()))

  @pl.when(i == 0)
  def _():
    dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)
    dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)

  @pl.when(j == 0)
  def _():
    dq_acc_ref[i] = jnp.zeros(dq_acc_ref.shape[1:], jnp.float32)

  @pl.when(core.block_visible(causal, i, j, bq, bk))
  def _():
    s_qk, mask = _scores(causal, i * bq, j * bk, q_ref, k_ref, segq_ref, segk_ref)
    g_qd = g_ref[0, 0]
    dv_acc_ref[...] += jax.lax.dot_general(s_qk.astype(g_qd.dtype), g_qd, contract_rows,
                                           preferred_element_type=jnp.float32)
    ds_qk = jax.lax.dot_general(g_qd, v_ref[0, 0], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
    ds_qk = (ds_qk if mask is None else jnp.where(mask, ds_qk, 0.0)).astype(q_ref.dtype)
    dq_acc_ref[i] += jnp.dot(ds_qk, k_ref[0, 0], preferred_element_type=jnp.float32) * d**-0.5
    dk_acc_ref[...] += jax.lax.dot_general(ds_qk, q_ref[0, 0], contract_rows,
                                           preferred_element_type=jnp.float32) * d**-0.5

  @pl.when(j == pl.num_programs(2) - 1)
  def _():
    dq_ref[0, 0] = dq_acc_ref[i].astype(dq_ref.dtype)

  @pl.when(i == pl.num_programs(3) - 1)
  def _():
    dk_ref[0, 0] = dk_acc_ref[...].astype(dk_ref.dtype)
    dv_ref[0, 0] = dv_acc_ref[...].astype(dv_ref.dtype)


def kernel_costs(causal: bool, shape, itemsize: int) -> dict[str, pl.CostEstimate]:
  """Each kernel's work for q, k, v of `shape` [B, H, T, d], as XLA's cost analysis counts it: d
  multiply-adds per pair of every visible tile and product (2 forward, 5 backward), and HBM traffic
  (forward: q and the output once, k and v once per visible tile; backward: k, v, dq, dk and dv once,
  q and g once per visible tile)."""
  B, H, T, d = shape
  tiles, b = visible_tiles(T, causal), block(T)
  row = B * H * d * itemsize

  def cost(products: int, outer_arrays: int, inner_arrays: int) -> pl.CostEstimate:
    return pl.CostEstimate(flops=2 * B * H * tiles * b * b * d * products, transcendentals=0,
                           bytes_accessed=row * (outer_arrays * T + inner_arrays * tiles * b))

  return {FORWARD: cost(2, 2, 2), BACKWARD: cost(5, 5, 2)}


def _check(shape):
  _, _, T, d = shape
  if T % BLOCKS[-1]:
    raise ValueError(
        f"the linear attention kernel tiles sequences in blocks of {BLOCKS[-1]}, got length {T}; "
        f"use a multiple of {BLOCKS[-1]} or impl 'auto'")
  if _dq_acc_bytes(shape) > DQ_ACC_LIMIT:
    raise ValueError(
        f"the linear attention kernel keeps a row's dq on chip, {_dq_acc_bytes(shape) / 2**20:.1f} "
        f"MiB at {T} tokens, more than its {DQ_ACC_LIMIT // 2**20} MiB; use impl 'chunked'")


def _dq_acc_bytes(shape) -> int:
  _, _, T, d = shape
  return T * -(-d // 128) * 128 * 4


def _specs(shape, causal: bool, segments: bool, *, keys_outer: bool, with_g: bool):
  """Block specs of (q, k, v[, g][, query segments, key segments]) for a grid (b, h, outer, inner):
  outer query blocks and inner key blocks, or (keys_outer) the other way round."""
  _, _, T, d = shape
  b = block(T)
  if keys_outer:
    ij = lambda o, n: (core.first_query_block(causal, n, o, b, b), o)
  else:
    ij = lambda o, n: (o, core.last_key_block(causal, o, n, b, b))
  query = pl.BlockSpec((1, 1, b, d), lambda r, h, o, n: (r, h, ij(o, n)[0], 0))
  key = pl.BlockSpec((1, 1, b, d), lambda r, h, o, n: (r, h, ij(o, n)[1], 0))
  specs = [query, key, key] + ([query] if with_g else [])
  if segments:
    specs += [
        pl.BlockSpec((1, b, 1), lambda r, h, o, n: (r, ij(o, n)[0], 0)),
        pl.BlockSpec((1, 1, b), lambda r, h, o, n: (r, 0, ij(o, n)[1])),
    ]
  return specs


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _core(causal, interpret, q_bhtd, k_bhtd, v_bhtd, seg_bt):
  return _core_fwd(causal, interpret, q_bhtd, k_bhtd, v_bhtd, seg_bt)[0]


def _core_fwd(causal, interpret, q_bhtd, k_bhtd, v_bhtd, seg_bt):
  _check(q_bhtd.shape)
  B, H, T, d = q_bhtd.shape
  b, segments = block(T), seg_bt is not None
  out = pl.pallas_call(
      functools.partial(_forward_kernel, causal=causal, segments=segments),
      grid=(B, H, T // b, T // b),
      in_specs=_specs(q_bhtd.shape, causal, segments, keys_outer=False, with_g=False),
      out_specs=pl.BlockSpec((1, 1, b, d), lambda r, h, i, j: (r, h, i, 0)),
      out_shape=jax.ShapeDtypeStruct(q_bhtd.shape, q_bhtd.dtype),
      scratch_shapes=[pltpu.VMEM((b, d), jnp.float32)],
      cost_estimate=kernel_costs(causal, q_bhtd.shape, q_bhtd.dtype.itemsize)[FORWARD],
      name=FORWARD,
      **core.kernel_params(interpret, ("parallel", "parallel", "parallel", "arbitrary"), VMEM_LIMIT),
  )(q_bhtd, k_bhtd, v_bhtd, *core.segment_blocks(seg_bt))
  return out, (q_bhtd, k_bhtd, v_bhtd, seg_bt)


def _core_bwd(causal, interpret, residuals, g_bhtd):
  q_bhtd, k_bhtd, v_bhtd, seg_bt = residuals
  B, H, T, d = q_bhtd.shape
  b, segments, n = block(T), seg_bt is not None, T // block(T)
  row_block = pl.BlockSpec((1, 1, b, d), lambda r, h, j, i: (r, h, j, 0))
  dq, dk, dv = pl.pallas_call(
      functools.partial(_backward_kernel, causal=causal, segments=segments),
      grid=(B, H, n, n),
      in_specs=_specs(q_bhtd.shape, causal, segments, keys_outer=True, with_g=True),
      # dq's block index moves only at the last key block, where the kernel writes it.
      out_specs=[
          pl.BlockSpec((1, 1, b, d), lambda r, h, j, i: (r, h, jnp.where(j == n - 1, i, 0), 0)), row_block,
          row_block
      ],
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q_bhtd, k_bhtd, v_bhtd)],
      scratch_shapes=[
          pltpu.VMEM((n, b, d), jnp.float32),
          pltpu.VMEM((b, d), jnp.float32),
          pltpu.VMEM((b, d), jnp.float32)
      ],
      cost_estimate=kernel_costs(causal, q_bhtd.shape, q_bhtd.dtype.itemsize)[BACKWARD],
      name=BACKWARD,
      **core.kernel_params(interpret, ("parallel", "parallel", "arbitrary", "arbitrary"),
                           VMEM_LIMIT + _dq_acc_bytes(q_bhtd.shape)),
  )(q_bhtd, k_bhtd, v_bhtd, g_bhtd.astype(q_bhtd.dtype), *core.segment_blocks(seg_bt))
  return dq, dk, dv, None


_core.defvjp(_core_fwd, _core_bwd)
