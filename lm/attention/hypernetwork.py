"""The hypernetwork value network (HYLA and its rms_head / none ablations) in Pallas TPU kernels that
keep every tile's value-network tensors on chip.

XLA's form of the blocked kernel (blocked.py) writes each tile's [rows, queries, keys, d] tensors (z,
φ(z), their gradients) to HBM between fusions; here a tile's z lives in VMEM only, and HBM sees q, k, v,
the output and their gradients, as for flash attention. A grid step is one tile of BLOCK_Q queries by
BLOCK_K keys, keys on the lanes, q, k and v transposed ([d, positions]) so that d = 64 does not leave half
of each tile's lanes empty. Products that contract over keys or d go to the MXU batched over queries
(`_per_query`); the vector unit's work (z, the cotangent of a through z) is written one query at a time
so that the compiler keeps it in registers. The backward pass is one kernel that recomputes each tile and
accumulates dq, dk and dv on chip. Causal tiles above the diagonal are skipped; those on it pack groups of
queries with few visible keys into shared rows (`_Rows`, `_row_sets`). keep_z: the forward kernel keeps
z (for relu, φ(z)) in HBM for the backward kernel instead of recomputing it. No bias, no dropout:
lm/attention/__init__.py's table sends those calls to the blocked kernel. The tile sizes, layouts and
loop shapes were chosen by the compiler's schedule for v5e (docs/results/compile_v5e.md).
"""

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lm.attention import core

# Tiles of 128 queries: of 16 to 128, the fewest cycles a token in v5e's schedule
# (docs/results/compile_v5e.md).
# A tile's float32 [BQ, d, BK] arrays (z, φ(z), dz) are 4 MB each at d = 64; the backward kernel holds
# several beside its blocks, so the scoped VMEM limit is raised from 16 MB (a v5e chip has 128 MiB).
BLOCK_Q, BLOCK_K = 128, 128
# A causal diagonal tile's queries in GROUPS groups: group m sees the tile's first (m + 1) / GROUPS of
# the keys, so two groups whose keys fill BLOCK_K lanes between them share rows (`_row_sets`); 8 by
# the compiler's schedule (docs/results/compile_v5e.md).
GROUPS = 8
FORWARD, BACKWARD = "hypernetwork_fwd", "hypernetwork_bwd"  # the kernels' pallas_call names
VMEM_LIMIT = 32 * 2**20
# The backward kernel's float32 dq for a whole row, on top of VMEM_LIMIT: 1 MiB at c4_50m's 512 tokens,
# 8 heads of 64; this much reaches 32,768 tokens there and stays inside a v5e chip's VMEM.
DQ_ACC_LIMIT = 64 * 2**20


def attend_pallas_hypernetwork(q: jax.Array, k: jax.Array, v: jax.Array, *, knobs: core.Knobs,
                               causal: bool = True, segment_ids: jax.Array | None = None,
                               batch_axes: tuple[str, ...] = (), interpret: bool = False,
                               keep_z: bool = False, only: str | None = None) -> jax.Array:
  """core.reference's contract for the hypernetwork value network with rms_head or none
  normalisation, lengths a multiple of BLOCK_K, on each device's shard. interpret: Pallas's
  interpreter (any backend). keep_z: z kept from the forward pass for the backward (module docstring).
  only: "below" or "diagonal" builds kernels that compute only those causal tiles, named
  `program_name(FORWARD or BACKWARD, only)`, to count each program's schedule alone
  (launch/aot/kernel_schedule.py): their results are not the attention."""
  static = _Static(knobs, causal, interpret, keep_z, only)
  local = lambda q, k, v, seg, _: _attend(q, k, v, seg, static=static)
  return core.per_device(local, q, k, v, segment_ids, None, batch_axes, split_heads=False)


def _attend(q, k, v, segment_ids, *, static):
  # Kernel layout: heads before positions; q, k and v transposed so that positions are the minor (lane)
  # axis: XLA's projections then write them 128 lanes wide, where [.., d] at d = 64 fills half of each
  # tile's lanes.
  qt_bhdt, kt_bhdt, vt_bhdt = (jnp.transpose(x, (0, 2, 3, 1)) for x in (q, k, v))
  seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
  return jnp.swapaxes(_core(static, qt_bhdt, kt_bhdt, vt_bhdt, seg), 1, 2)


@dataclasses.dataclass(frozen=True)
class _Static:
  """The static part of a call: what the kernels are built from."""
  knobs: core.Knobs
  causal: bool
  interpret: bool
  keep_z: bool
  only: str | None = None  # attend_pallas_hypernetwork's


def _tile_index(causal: bool, i, j, nk: int):
  """Where the tile of query block i and key block j is kept among a row's visible tiles, row by row
  (causal: query block i sees key blocks 0..i, as BLOCK_Q == BLOCK_K)."""
  return jax.lax.div(i * (i + 1), 2) + j if causal else i * nk + j


def _sum_terms(terms: list[jax.Array]) -> jax.Array:
  """Σ of the terms (the heads', or the queries') from the first (Python's sum would add the first to 0:
  one more pass on the vector unit)."""
  return functools.reduce(operator.add, terms)


def _per_query(x, y, contract_x: int, contract_y: int) -> jax.Array:
  """Products batched over the leading (query) axis of x and y, on the MXU, summed in float32."""
  return jax.lax.dot_general(x, y, (((contract_x,), (contract_y,)), ((0,), (0,))),
                             preferred_element_type=jnp.float32)


def _tile(static: _Static, q0, k0, qt_hdq, kt_ref, vt_ref, segq_q1, segk_1k, a_ref):
  """The tile of queries qᵀ [H, d, BQ] from position q0 and the key block from k0, up to the weights:
  the mask [BQ, BK] (or None), the normalisation's pullback, the weights a [1, H, BQ, BK] (also stored
  in the scratch a_ref [H, BQ, BK], for `_row`) and vᵀ [H, d, BK], float32. segq_q1 [BQ, 1] and segk_1k
  [1, BK]: segment ids, or None."""
  H, d, bq = qt_hdq.shape
  bk = kt_ref.shape[3]
  mask = core.tile_mask(static.causal, q0, k0, bq, bk, segq_q1, segk_1k)
  contract_d = (((0,), (0,)), ((), ()))
  s_1hqk = jnp.stack([
      jax.lax.dot_general(qt_hdq[h], kt_ref[0, h], contract_d, preferred_element_type=jnp.float32)
      for h in range(H)
  ])[None] * d**-0.5
  mask_11qk = None if mask is None else mask[None, None]
  if mask_11qk is not None:
    s_1hqk = jnp.where(mask_11qk, s_1hqk, 0.0)
  a_1hqk, normalize_pullback = jax.vjp(
      lambda s: core.normalize(s, mask_11qk, normalization=static.knobs.normalization), s_1hqk)
  a_ref[...] = a_1hqk[0]
  return mask_11qk, normalize_pullback, a_1hqk, vt_ref[0].astype(jnp.float32)


def _keeps_output(static: _Static) -> bool:
  """Whether keep_z keeps φ(z) rather than z: for relu, whose φ' follows from φ(z) (module docstring);
  the backward kernel then neither converts z nor forms φ(z) again."""
  return static.knobs.nonlinearity == "relu"


def _row(a_ref, h: int, q: int) -> jax.Array:
  """a_h's row of query q, [1, BK], to broadcast over d, loaded from the scratch that `_tile` fills: a
  row loaded alone comes replicated over the sublanes (a load of sublane stride 0, in the load slots),
  where a row broadcast from a register took a sublane permute on the vector unit, which the compiler
  spilled rather than redo."""
  return a_ref[h, pl.ds(q, 1), :]


def _z(a_ref, vt_hdk, rows: range) -> jax.Array:
  """z [rows, d, BK] = Σ_h a_h vᵀ_h, one query at a time, a's rows from a_ref (`_row`)."""
  return jnp.stack([_sum_terms([_row(a_ref, h, q) * vt_hdk[h] for h in range(a_ref.shape[0])]) for q in rows])


@dataclasses.dataclass(frozen=True)
class _Rows:
  """Queries of a tile computed in the same rows: lo..lo + n, with their keys on the lanes below split,
  and, when hi is set, hi..hi + n, with their keys rolled to the lanes from split on."""
  lo: int
  n: int
  hi: int | None = None
  split: int = BLOCK_K

  def below(self, shape, split: int | None = None) -> jax.Array:
    """The lanes (last axis) below split (by default the lo queries')."""
    return jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1) < (split or self.split)

  def pack(self, x_hqk) -> jax.Array:
    """[.., n, BK] from a tile's [.., BQ, BK]: the lo queries' rows, the hi queries' rolled in."""
    lo = x_hqk[..., self.lo:self.lo + self.n, :]
    if self.hi is None:
      return lo
    hi = x_hqk[..., self.hi:self.hi + self.n, :]
    return jnp.where(self.below(lo.shape), lo, pltpu.roll(hi, self.split, lo.ndim - 1))

  def unpack(self, x) -> list[tuple[int, jax.Array]]:
    """`pack` undone: (first query, rows [.., n, BK], the other lanes zero) for lo and hi."""
    if self.hi is None:
      return [(self.lo, x)]
    back = BLOCK_K - self.split
    return [(self.lo, jnp.where(self.below(x.shape), x, 0.0)),
            (self.hi, jnp.where(self.below(x.shape, back), pltpu.roll(x, back, x.ndim - 1), 0.0))]

  def fold(self, x_dk) -> jax.Array:
    """A sum over the rows [d, BK] onto the keys: the hi queries' lanes added back onto theirs."""
    return x_dk if self.hi is None else _sum_terms([x for _, x in self.unpack(x_dk)])

  def spread(self, vt_hdk) -> jax.Array:
    """vᵀ [H, d, BK] as the rows' lanes see it: the hi queries' keys rolled to theirs."""
    return vt_hdk if self.hi is None else jnp.where(self.below(vt_hdk.shape), vt_hdk,
                                                    pltpu.roll(vt_hdk, self.split, 2))

  def queries(self, x_rhk) -> jax.Array:
    """[n, H', BK] from the rows' [n, H, BK]: as they are, or as two queries' (H' = 2H), the lo queries'
    on their lanes and the hi queries' on theirs, for the products per row."""
    if self.hi is None:
      return x_rhk
    low = self.below(x_rhk.shape)
    return jnp.concatenate([jnp.where(low, x_rhk, 0.0), jnp.where(low, 0.0, x_rhk)], axis=1)

  def outputs(self, x_rhx) -> list[tuple[int, jax.Array]]:
    """(first query, [n, H, ..]) of the lo and hi queries from a product's [n, H', ..] (`queries`)."""
    H = x_rhx.shape[1] // (1 + (self.hi is not None))
    return [(self.lo, x_rhx[:, :H])] + ([(self.hi, x_rhx[:, H:])] if self.hi is not None else [])


def _row_sets(diagonal: bool) -> tuple[_Rows, ...]:
  """A tile's rows: every query alone, or on the causal diagonal the GROUPS groups of queries packed, the
  last group alone, each other group m with group GROUPS - 2 - m (their keys fill the lanes), a middle
  group with itself, its two halves on the two halves of the lanes."""
  if not diagonal:
    return (_Rows(0, BLOCK_Q),)
  q = BLOCK_Q // GROUPS
  sets = [_Rows((GROUPS - 1) * q, q)]
  sets += [_Rows((GROUPS - 2 - m) * q, q, m * q, (GROUPS - 1 - m) * q) for m in range((GROUPS - 1) // 2)]
  if GROUPS % 2 == 0:
    middle = (GROUPS - 2) // 2 * q
    sets.append(_Rows(middle, q // 2, middle + q // 2, BLOCK_K // 2))
  return tuple(sets)


def _weights(rows: _Rows, a_hqk, a_ref, ap_ref, vt_hdk):
  """A set of rows' queries (a slice of the tile's), the scratch holding their weights for `_row` (a
  packed set's stored in ap_ref at its lo queries) and vᵀ as their lanes see it."""
  own = slice(rows.lo, rows.lo + rows.n)
  if rows.hi is None:
    return own, a_ref, vt_hdk
  vt_rdk = rows.spread(vt_hdk)
  ap_ref[:, own] = rows.pack(a_hqk)
  return own, ap_ref, vt_rdk


def _gathered(pieces: list[tuple[int, jax.Array]], axis: int) -> jax.Array:
  """The pieces (first query, rows) joined along axis in the order of their queries."""
  return jnp.concatenate([x for _, x in sorted(pieces, key=lambda piece: piece[0])], axis=axis)


def _da(da_out_qhk, dz_qdk, vt_hdk, dtype) -> jax.Array:
  """The weights' cotangent [H, Q, BK] of Q rows: da_out_qhk, the part through the output, plus Σ_d dz ·
  v_h, the part through z. In bfloat16 that sum goes query by query: the products on the vector unit,
  rounded to bfloat16, and each head's sum over d on the MXU, as a product with a row of ones in that
  head's row (on the vector unit the sums over d, adds then a reduction across sublanes and the rows
  put back together, took much of the backward kernel's schedule). Float32 operands would take the
  MXU twice the pushes, and their spills outgrow the kernel's VMEM: there the sums stay on the vector
  unit."""
  H, d = vt_hdk.shape[:2]
  if jnp.dtype(dtype).itemsize > 2:
    da_z_hqk = jnp.stack([jnp.stack([(dz_dk * vt_hdk[h]).sum(0) for dz_dk in dz_qdk]) for h in range(H)])
    return jnp.swapaxes(da_out_qhk, 0, 1) + da_z_hqk
  rows_hd = jax.lax.broadcasted_iota(jnp.int32, (H, d), 0)
  ones_hd = [(rows_hd == h).astype(dtype) for h in range(H)]
  da_z_qhk = jnp.stack([
      _sum_terms([
          jnp.dot(ones_hd[h], (dz_dk * vt_hdk[h]).astype(dtype), preferred_element_type=jnp.float32)
          for h in range(H)
      ])
      for dz_dk in dz_qdk
  ])
  return jnp.swapaxes(da_out_qhk + da_z_qhk, 0, 1)


def _loops_over_heads(dtype) -> bool:
  """Whether the backward kernel forms whole tiles' dv and da through z in `_da_dv_by_heads`: in
  bfloat16, where the MXU's operands are rounded to bfloat16 anyway; in float32 the sums over d stay
  on the vector unit (`_da`)."""
  return jnp.dtype(dtype).itemsize == 2


def heads_per_trip(H: int) -> int:
  """Heads per trip of `_da_dv_by_heads`'s loop: up to 4, the shortest schedule at 8 heads
  (docs/results/compile_v5e.md)."""
  return next(n for n in (4, 2, 1) if H % n == 0)


def head_loop_trips(H: int) -> int:
  """Trips of `_da_dv_by_heads`'s loop, whose body the compiler's listing holds once
  (launch/aot/kernel_schedule.py counts it this many times)."""
  return H // heads_per_trip(H)


def _da_dv_by_heads(da_out_qhk, dz_qdk, vt_ref, a_ref, dvt_acc_ref, dz_ref, daz_ref) -> jax.Array:
  """A whole tile's weights' cotangent [H, Q, BK] (da_out_qhk plus Σ_d dz · v_h) in bfloat16, and dv's
  share, Σ_q a_h dz, added to dvt_acc_ref; the weights from a_ref (`_row`). Both
  multiply dz by a head's tensor and need all queries, so they run in a loop over heads, a few a trip,
  with dz in a scratch: a head's dv (8 vregs at d = 64) and vᵀ_h stay in registers across the queries.
  Written over the whole tile instead, the compiler formed every head's products first, spilled them,
  and then fed the MXU. The sums over d go to the MXU 8 queries a product, a row of
  ones per query: one [8, BK] result per head and 8 queries, in da's layout. Their operands stay
  float32, which on TPU the MXU rounds to bfloat16 as it rounded the products before (pushing the
  rounded products took 4 vector packs per query and head; float32 pushes are twice as many, in MXU
  slots the loop leaves free)."""
  H, d = vt_ref.shape[1:3]
  Q = dz_qdk.shape[0]
  dz_ref[...] = dz_qdk
  group = 8  # queries a product: a float32 vreg's sublanes
  rows_gd = jax.lax.broadcasted_iota(jnp.int32, (group, d), 0)
  ones = [(rows_gd == r).astype(jnp.float32) for r in range(group)]
  per = heads_per_trip(H)

  def heads(i, carry):
    for h in [i * per + u for u in range(per)]:
      vt_dk = vt_ref[0, h].astype(jnp.float32)
      dv_terms = []
      for q0 in range(0, Q, group):
        sums = []
        for q in range(q0, q0 + group):  # dz's rows loaded once for both
          dz_dk = dz_ref[q]
          dv_terms.append(_row(a_ref, h, q) * dz_dk)
          sums.append(jnp.dot(ones[q - q0], dz_dk * vt_dk, preferred_element_type=jnp.float32))
        daz_ref[h, q0:q0 + group] = _sum_terms(sums)
      dvt_acc_ref[h] += _sum_terms(dv_terms)
    return carry

  jax.lax.fori_loop(0, head_loop_trips(H), heads, 0)
  return jnp.swapaxes(da_out_qhk, 0, 1) + daz_ref[...]


def _branches(static: _Static, i, j):
  """When a grid step at query block i and key block j computes a whole tile, and when a packed
  diagonal one (None: never, in this build of the kernel)."""
  if not static.causal:
    return True, None
  whole, diagonal = j < i, i == j  # BLOCK_Q == BLOCK_K: the diagonal tile is (i, i)
  return {None: (whole, diagonal), "below": (whole, None), "diagonal": (None, diagonal)}[static.only]


def _kept(static: _Static, z_ref, rows: slice, recompute):
  """φ(z) of a tile's rows `rows` and φ's pullback, from what the forward pass kept in z_ref (for relu
  φ(z), `_keeps_output`), or from z = recompute() when it kept nothing."""
  if z_ref is not None and _keeps_output(static):
    p_qdk = z_ref[0, 0, rows]
    positive_qdk = p_qdk.astype(jnp.float32) > 0
    return p_qdk, lambda dp_qdk: jnp.where(positive_qdk, dp_qdk, 0.0)
  z_qdk = recompute() if z_ref is None else z_ref[0, 0, rows].astype(jnp.float32)
  p_qdk, pullback = jax.vjp(core.NONLINEARITIES[static.knobs.nonlinearity], z_qdk)
  return p_qdk, lambda dp_qdk: pullback(dp_qdk)[0]


def _row_grads(g_qhd, a_qhk, p_qdk, phi_pullback):
  """For rows of queries with g [Q, H', d], a [Q, H', BK] and φ(z) [Q, d, BK]: dz [Q, d, BK] and the
  weights' cotangent through the output, Σ_d g_h · φ(z), [Q, H', BK]. φ(z)'s cotangent Σ_h g_h a_h
  takes operands in the compute dtype, as the MXU rounds them on TPU anyway: g as it arrives, a
  rounded (in bfloat16, half the MXU's pushes of float32 operands)."""
  dz_qdk = phi_pullback(_per_query(g_qhd, a_qhk.astype(g_qhd.dtype), 1, 1))
  return dz_qdk, _per_query(g_qhd.astype(p_qdk.dtype), p_qdk, 2, 1)


def _tile_grads(static: _Static, q0, k0, q_ref, k_ref, vt_ref, g_ref, segq_ref, segk_ref, z_ref, a_ref,
                ap_ref, diagonal: bool, head_loop):
  """Keeps the tile's weights a in a_ref [H, BQ, BK] (packed rows' in ap_ref, at their lo queries) and
  returns the cotangent ds [1, H, BQ, BK] of the scaled scores (the caller applies 1/sqrt(d) for dq and
  dk) and, per set of rows (`_row_sets`) whose dv is left to the caller, the rows, the scratch holding
  their weights and dz [n, d, BK]; given the output's cotangent g [H, BQ, d]; z (for relu φ(z)) read
  from z_ref when the forward pass kept it, else recomputed. head_loop: (dvᵀ's accumulator, scratch for
  dz and for the part of da through z) for `_da_dv_by_heads`, which takes whole tiles in bfloat16."""
  segq_q1, segk_1k = (None, None) if segq_ref is None else (segq_ref[0], segk_ref[0])
  mask_11qk, normalize_pullback, a_1hqk, vt_hdk = _tile(static, q0, k0, q_ref[0], k_ref, vt_ref, segq_q1,
                                                        segk_1k, a_ref)
  g_qhd = jnp.swapaxes(g_ref[0], 0, 1)
  das, dzs = [], []
  for rows in _row_sets(diagonal):
    own, weights_ref, vt_r = _weights(rows, a_1hqk[0], a_ref, ap_ref, vt_hdk)
    g_r = g_qhd[own] if rows.hi is None else jnp.concatenate([g_qhd[own], g_qhd[rows.hi:rows.hi + rows.n]], 1)
    p_rdk, phi_pullback = _kept(static, z_ref, own,
                                lambda: _z(weights_ref, vt_r, range(rows.lo, rows.lo + rows.n)))
    a_rhk = rows.queries(jnp.swapaxes(weights_ref[:, own], 0, 1))
    dz_rdk, da_out_rhk = _row_grads(g_r, a_rhk, p_rdk, phi_pullback)
    if rows.hi is not None:  # each lane's query: the lo queries' heads below split, the hi queries' above
      lo, hi = (x for _, x in rows.outputs(da_out_rhk))
      da_out_rhk = jnp.where(rows.below(lo.shape), lo, hi)
    if not diagonal and _loops_over_heads(q_ref.dtype):
      das.append((rows.lo, _da_dv_by_heads(da_out_rhk, dz_rdk, vt_ref, weights_ref, *head_loop)))
    else:
      das += rows.unpack(_da(da_out_rhk, dz_rdk, vt_r, q_ref.dtype))
      dzs.append((rows, weights_ref, dz_rdk))
  ds_1hqk = normalize_pullback(_gathered(das, 1)[None])[0]
  if mask_11qk is not None:
    ds_1hqk = jnp.where(mask_11qk, ds_1hqk, 0.0)
  return ds_1hqk, dzs


def _forward_kernel(*refs, static, segments):
  q_ref, k_ref, vt_ref = refs[:3]
  segq_ref, segk_ref = refs[3:5] if segments else (None, None)
  out_ref, z_ref, acc_ref, a_ref, ap_ref = refs[-5:] if static.keep_z else (refs[-4], None, *refs[-3:])
  i, j = pl.program_id(1), pl.program_id(2)
  bq, bk = q_ref.shape[3], k_ref.shape[3]
  phi = core.NONLINEARITIES[static.knobs.nonlinearity]

  @pl.when(j == 0)
  def _():
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  def compute(diagonal: bool):
    segq_q1, segk_1k = (None, None) if segq_ref is None else (segq_ref[0], segk_ref[0])
    _, _, a_1hqk, vt_hdk = _tile(static, i * bq, j * bk, q_ref[0], k_ref, vt_ref, segq_q1, segk_1k, a_ref)
    outs = []
    for rows in _row_sets(diagonal):
      own, weights_ref, vt_r = _weights(rows, a_1hqk[0], a_ref, ap_ref, vt_hdk)
      z_rdk = _z(weights_ref, vt_r, range(rows.lo, rows.lo + rows.n))
      p_rdk = phi(z_rdk)
      if z_ref is not None:
        z_ref[0, 0, own] = (p_rdk if _keeps_output(static) else z_rdk).astype(z_ref.dtype)
      a_rhk = rows.queries(jnp.swapaxes(weights_ref[:, own], 0, 1))
      outs += rows.outputs(_per_query(a_rhk, p_rdk, 2, 2))
    acc_ref[...] += _gathered(outs, 0)

  for when, diagonal in zip(_branches(static, i, j), (False, True)):
    if when is not None:
      pl.when(when)(functools.partial(compute, diagonal))

  @pl.when(j == pl.num_programs(2) - 1)
  def _():
    out_ref[0] = jnp.swapaxes(acc_ref[...], 0, 1).astype(out_ref.dtype)


def _backward_kernel(*refs, static, segments):
  """dkᵀ and dvᵀ accumulated over the query blocks of key block j, dqᵀ over the key blocks of the row
  (dq_acc [query blocks, H, d, BQ]), written at the last key block; a_ref holds the tile's weights
  (ap_ref packed rows' on the diagonal)."""
  q_ref, k_ref, vt_ref, g_ref = refs[:4]
  z_ref = refs[4] if static.keep_z else None
  segq_ref, segk_ref = refs[4 + static.keep_z:][:2] if segments else (None, None)
  _, H, d, bq = q_ref.shape
  n = 8 + len(_head_loop_scratch(H, d, q_ref.dtype))
  dq_ref, dk_ref, dvt_ref, dq_acc_ref, dk_acc_ref, dvt_acc_ref, a_ref, ap_ref, *head_scratch = refs[-n:]
  j, i = pl.program_id(1), pl.program_id(2)
  bk = k_ref.shape[3]

  @pl.when(i == 0)
  def _():
    dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)
    dvt_acc_ref[...] = jnp.zeros(dvt_acc_ref.shape, jnp.float32)

  @pl.when(j == 0)
  def _():
    dq_acc_ref[i] = jnp.zeros(dq_acc_ref.shape[1:], jnp.float32)

  def accumulate(diagonal: bool):
    ds_1hqk, dzs = _tile_grads(static, i * bq, j * bk, q_ref, k_ref, vt_ref, g_ref, segq_ref, segk_ref, z_ref,
                               a_ref, ap_ref, diagonal, (dvt_acc_ref, *head_scratch))
    contract_k = (((1,), (1,)), ((), ()))
    for h in range(H):
      ds_qk = ds_1hqk[0, h].astype(q_ref.dtype)
      dq_acc_ref[i, h] += jax.lax.dot_general(k_ref[0, h], ds_qk, contract_k,
                                              preferred_element_type=jnp.float32) * d**-0.5
      dk_acc_ref[h] += jnp.dot(q_ref[0, h], ds_qk, preferred_element_type=jnp.float32) * d**-0.5
      if not dzs:
        continue
      dvt_acc_ref[h] += _sum_terms([
          rows.fold(_sum_terms([_row(weights_ref, h, rows.lo + r) * dz_dk
                                for r, dz_dk in enumerate(dz_rdk)]))
          for rows, weights_ref, dz_rdk in dzs
      ])

  for when, diagonal in zip(_branches(static, i, j), (False, True)):
    if when is not None:
      pl.when(when)(functools.partial(accumulate, diagonal))

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    dq_ref[0] = dq_acc_ref[i].astype(dq_ref.dtype)

  @pl.when(i == pl.num_programs(2) - 1)
  def _():
    dk_ref[0] = dk_acc_ref[...].astype(dk_ref.dtype)
    dvt_ref[0] = dvt_acc_ref[...].astype(dvt_ref.dtype)


def _specs(static: _Static, shape, segments: bool, *, keys_outer: bool, with_g: bool):
  """Block specs of (qᵀ, kᵀ, vᵀ[, g, kept z][, query segments, key segments]) for a grid (b, outer, inner)
  over blocks of BLOCK_Q queries and BLOCK_K keys: outer query blocks and inner key blocks, or
  (keys_outer) the other way round; and the spec of a kept z's tile on that grid."""
  _, H, T, d = shape
  bq, bk, causal = BLOCK_Q, BLOCK_K, static.causal
  if keys_outer:
    qi = lambda j, i: core.first_query_block(causal, i, j, bq, bk)
    ij = lambda o, n: (qi(o, n), o)
  else:
    ij = lambda o, n: (o, core.last_key_block(causal, o, n, bq, bk))
  keys = pl.BlockSpec((1, H, d, bk), lambda b, o, n: (b, 0, 0, ij(o, n)[1]))
  specs = [pl.BlockSpec((1, H, d, bq), lambda b, o, n: (b, 0, 0, ij(o, n)[0])), keys, keys]
  tile = pl.BlockSpec((1, 1, bq, d, bk), lambda b, o, n:
                      (b, _tile_index(causal, *ij(o, n), T // bk), 0, 0, 0))
  if with_g:
    g = pl.BlockSpec((1, H, bq, d), lambda b, o, n: (b, 0, ij(o, n)[0], 0))
    specs += [g, tile] if static.keep_z else [g]
  if segments:
    specs += [
        pl.BlockSpec((1, bq, 1), lambda b, o, n: (b, ij(o, n)[0], 0)),
        pl.BlockSpec((1, 1, bk), lambda b, o, n: (b, 0, ij(o, n)[1])),
    ]
  return specs, tile


def _weights_scratch(H: int):
  """Both kernels' scratch for a tile's weights a and a diagonal tile's packed rows of them (`_row`)."""
  return [pltpu.VMEM((H, BLOCK_Q, BLOCK_K), jnp.float32)] * 2


def _head_loop_scratch(H: int, d: int, dtype):
  """The backward kernel's scratch for `_da_dv_by_heads`: a tile's dz and the part of da through z."""
  if not _loops_over_heads(dtype):
    return []
  return [pltpu.VMEM((BLOCK_Q, d, BLOCK_K), jnp.float32), pltpu.VMEM((H, BLOCK_Q, BLOCK_K), jnp.float32)]


def visible_tiles(T: int, causal: bool) -> int:
  """How many tiles (grid steps) either kernel computes per batch row."""
  return core.visible_blocks(T, BLOCK_Q, BLOCK_K, causal)


def tile_programs(T: int, causal: bool) -> list[tuple[str | None, int]]:
  """The kernels' programs for tiles of a kind, as attend_pallas_hypernetwork's `only` builds them
  alone, and how many grid steps of a batch row run each: causally, the tiles below the diagonal
  (whole) and those on it (packed); otherwise every tile, whole."""
  n = T // BLOCK_Q
  return [("below", n * (n - 1) // 2), ("diagonal", n)] if causal else [(None, n * n)]


def program_name(kernel: str, only: str | None) -> str:
  """The pallas_call name of `kernel` (FORWARD, BACKWARD) built with attend_pallas_hypernetwork's
  `only`."""
  return kernel if only is None else f"{kernel}_{only}"


def kernel_costs(knobs: core.Knobs, causal: bool, shape, itemsize: int,
                 keep_z: bool = False) -> dict[str, pl.CostEstimate]:
  """Each kernel's work for q, k, v of `shape` [B, H, T, d], as XLA's cost analysis counts it: H x d
  multiply-adds per pair and product, on every pair of a visible tile for the products with the scores
  (forward 1, backward 3), on the pairs computed for the value network's (forward 2, backward 5, 4 with
  keep_z; a causal diagonal tile packs its queries into fewer rows, `_row_sets`), and HBM traffic.
  Forward: q and the output once, k and vᵀ once per visible tile; backward: k, vᵀ, dq, dk and dvᵀ once,
  q and g once per visible tile; with keep_z, every visible tile's z written forward and read backward."""
  B, H, T, d = shape
  tiles = visible_tiles(T, causal)
  packed = sum(
      n * sum(rows.n for rows in _row_sets(only == "diagonal")) for only, n in tile_programs(T, causal))
  row = H * d * itemsize
  z_bytes = keep_z * B * tiles * BLOCK_Q * BLOCK_K * d * itemsize

  def cost(products: int, value_products: int, outer_arrays: int, inner_arrays: int) -> pl.CostEstimate:
    return pl.CostEstimate(
        flops=2 * B * BLOCK_K * H * d * (tiles * BLOCK_Q * products + packed * value_products),
        transcendentals=B * tiles * BLOCK_Q * BLOCK_K * (knobs.normalization == "rms_head"),
        bytes_accessed=B * row * (outer_arrays * T + inner_arrays * tiles * BLOCK_K) + z_bytes)

  return {FORWARD: cost(1, 2, 2, 2), BACKWARD: cost(3, 5 - keep_z, 5, 2)}


def _costs(static: _Static, qt_bhdt) -> dict[str, pl.CostEstimate]:
  return kernel_costs(static.knobs, static.causal, _shape(qt_bhdt), qt_bhdt.dtype.itemsize, static.keep_z)


def _check(shape):
  _, H, T, d = shape
  if T % BLOCK_K:
    raise ValueError(f"the hypernetwork kernel tiles sequences in blocks of {BLOCK_K}, got length {T}; "
                     f"use a multiple of {BLOCK_K} or impl 'auto'")
  if _dq_acc_bytes(shape) > DQ_ACC_LIMIT:
    raise ValueError(f"the hypernetwork kernel keeps a row's dq on chip, {_dq_acc_bytes(shape) / 2**20:.1f} "
                     f"MiB at {T} tokens and {H} heads of {d} per device, more than its "
                     f"{DQ_ACC_LIMIT // 2**20} MiB; use impl 'blocked', or split the heads over more devices")


def _dq_acc_bytes(shape) -> int:
  _, H, T, d = shape
  return T * H * d * 4


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(static, qt_bhdt, kt_bhdt, vt_bhdt, seg_bt):
  return _core_fwd(static, qt_bhdt, kt_bhdt, vt_bhdt, seg_bt)[0]


def _shape(qt_bhdt) -> tuple[int, int, int, int]:
  """[B, H, T, d] of qᵀ [B, H, d, T]."""
  B, H, d, T = qt_bhdt.shape
  return B, H, T, d


def _core_fwd(static, qt_bhdt, kt_bhdt, vt_bhdt, seg_bt):
  shape = _shape(qt_bhdt)
  _check(shape)
  B, H, T, d = shape
  segments = seg_bt is not None
  in_specs, tile = _specs(static, shape, segments, keys_outer=False, with_g=False)
  out_specs = [pl.BlockSpec((1, H, BLOCK_Q, d), lambda b, i, j: (b, 0, i, 0))]
  out_shape = [jax.ShapeDtypeStruct(shape, qt_bhdt.dtype)]
  if static.keep_z:
    out_specs.append(tile)
    out_shape.append(
        jax.ShapeDtypeStruct((B, visible_tiles(T, static.causal), BLOCK_Q, d, BLOCK_K), qt_bhdt.dtype))
  out, *z = pl.pallas_call(
      functools.partial(_forward_kernel, static=static, segments=segments),
      grid=(B, T // BLOCK_Q, T // BLOCK_K),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((BLOCK_Q, H, d), jnp.float32), *_weights_scratch(H)],
      cost_estimate=_costs(static, qt_bhdt)[FORWARD],
      name=program_name(FORWARD, static.only),
      **core.kernel_params(static.interpret, ("parallel", "parallel", "arbitrary"), VMEM_LIMIT),
  )(qt_bhdt, kt_bhdt, vt_bhdt, *core.segment_blocks(seg_bt))
  return out, (qt_bhdt, kt_bhdt, vt_bhdt, seg_bt, z)


def _core_bwd(static, residuals, g_bhtd):
  qt_bhdt, kt_bhdt, vt_bhdt, seg_bt, z = residuals
  B, H, T, d = shape = _shape(qt_bhdt)
  segments = seg_bt is not None
  args = (qt_bhdt, kt_bhdt, vt_bhdt, g_bhtd.astype(qt_bhdt.dtype), *z, *core.segment_blocks(seg_bt))
  # One pass over the tiles for all three gradients (the tiles' vector work is most of the kernel's
  # time). dq's block index moves only at the last key block, where the kernel writes it (module
  # docstring); the row's dq accumulator carries over key blocks, so they run in order.
  nk, nq = T // BLOCK_K, T // BLOCK_Q
  dq_acc = pltpu.VMEM((nq, H, d, BLOCK_Q), jnp.float32)
  dqt, dkt, dvt = pl.pallas_call(
      functools.partial(_backward_kernel, static=static, segments=segments),
      grid=(B, nk, nq),
      in_specs=_specs(static, shape, segments, keys_outer=True, with_g=True)[0],
      out_specs=[
          pl.BlockSpec((1, H, d, BLOCK_Q), lambda b, j, i: (b, 0, 0, jnp.where(j == nk - 1, i, 0))),
          pl.BlockSpec((1, H, d, BLOCK_K), lambda b, j, i: (b, 0, 0, j)),
          pl.BlockSpec((1, H, d, BLOCK_K), lambda b, j, i: (b, 0, 0, j)),
      ],
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (qt_bhdt, kt_bhdt, vt_bhdt)],
      scratch_shapes=[
          dq_acc,
          pltpu.VMEM((H, d, BLOCK_K), jnp.float32),
          pltpu.VMEM((H, d, BLOCK_K), jnp.float32),
          *_weights_scratch(H),
          *_head_loop_scratch(H, d, qt_bhdt.dtype),
      ],
      cost_estimate=_costs(static, qt_bhdt)[BACKWARD],
      name=program_name(BACKWARD, static.only),
      **core.kernel_params(static.interpret, ("parallel", "arbitrary", "arbitrary"),
                           VMEM_LIMIT + _dq_acc_bytes(shape)),
  )(*args)
  return dqt, dkt, dvt, None


_core.defvjp(_core_fwd, _core_bwd)
