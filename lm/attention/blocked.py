"""Blocked attention: the core (lm/attention/core.py) tiled over query and key blocks, memory linear in
sequence length.

One [block, block] tile of scores (and, for the hypernetwork value network, one [batch, block, block, d]
tile of z) exists at a time, never [b, h, t, t] or [b, t, t, d]. The backward pass recomputes each tile
(custom VJP), so training memory is linear in t as well. Tiles wholly above the causal diagonal are skipped.
A tile's pullback comes from automatic differentiation for the linear value network and is written out
for the hypernetwork (_hypernetwork_pullback), whose z-sized tensors autodiff laid out badly.

rms_head and none normalise within one (q, k) pair, so a query's output is a plain sum over key tiles.
Softmax needs the row's log-sum-exp before any tile's weights are known, and the hypernetwork applies φ to
a sum over heads of weights with different denominators, so flash attention's online rescaling does not
carry over: a first pass computes the log-sum-exp, a second applies exact weights. Attention dropout
draws each tile's part of the one [t, t] mask from the pairs' positions (core.dropout_keep), the same
bits in the forward pass, in both backward passes, and in the reference. When one tile holds the
sequence, softmax attention with the linear value network runs the reference instead.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from lm.attention import core

# 64: faster on CPU than 128 or 256 for HYLA's forward and backward (docs/results/attention_speed.md).
BLOCK = 64


@dataclasses.dataclass(frozen=True)
class _Tiling:
  """The static part of a call: what the traced loops are built from."""
  knobs: core.Knobs
  causal: bool
  block: int
  dropout_rate: float


def _padded(x: jax.Array, axes: tuple[int, ...], length: int) -> jax.Array:
  pad = [(0, 0)] * x.ndim
  for axis in axes:
    pad[axis] = (0, length - x.shape[axis])
  return jnp.pad(x, pad)


def attend_blocked(q: jax.Array, k: jax.Array, v: jax.Array, *, knobs: core.Knobs, causal: bool = True,
                   segment_ids: jax.Array | None = None, bias: jax.Array | None = None,
                   dropout_rate: float = 0.0, dropout_rng: jax.Array | None = None,
                   block: int = BLOCK) -> jax.Array:
  """core.reference's contract, for as many keys as queries. Lengths that are not a multiple of
  `block` are padded with tokens in a segment of their own (the smallest int32, which no real segment
  id is), so no real query sees them."""
  B, T = q.shape[:2]
  if T <= block and (knobs.normalization, knobs.value_network) == ("softmax", "linear"):
    # Tiling saves no memory here, and softmax's second pass and the backward's recomputation only
    # repeat the definition's work (docs/results/compositional_throughput.md).
    return core.reference(q, k, v, knobs=knobs, causal=causal, segment_ids=segment_ids, bias=bias,
                          dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  block = min(block, T)
  Tp = -(-T // block) * block
  if Tp != T or segment_ids is not None:
    real_bt = jnp.broadcast_to(jnp.arange(Tp) < T, (B, Tp))
    seg_bt = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    segment_ids = jnp.where(real_bt, _padded(seg_bt, (1,), Tp), jnp.iinfo(jnp.int32).min)
    q, k, v = (_padded(x, (1,), Tp) for x in (q, k, v))
  if bias is not None:
    bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    bias = _padded(jnp.broadcast_to(bias, bias.shape[:2] + (T, T)), (2, 3), Tp)
  tiling = _Tiling(knobs, causal, block, dropout_rate)
  rng = dropout_rng if dropout_rate else None
  return _blocked(tiling, q, k, v, segment_ids, bias, rng)[:, :T].astype(q.dtype)


def _positions(tiling: _Tiling, index) -> jax.Array:
  return index * tiling.block + jnp.arange(tiling.block)


def _tile_mask(tiling: _Tiling, i, j, seg_bt):
  """The [b or 1, 1, block, block] mask of query block i against key block j."""
  q_pos, k_pos = _positions(tiling, i), _positions(tiling, j)
  seg = lambda pos: None if seg_bt is None else jnp.take(seg_bt, pos, axis=1)
  return core.pair_mask(q_pos, k_pos, causal=tiling.causal, q_segment_ids_bq=seg(q_pos),
                        k_segment_ids_bk=seg(k_pos))


def _dropped(tiling: _Tiling, i, j, rng, x_bhqk: jax.Array) -> jax.Array:
  """x with tile (i, j)'s dropout applied (its kept pairs scaled, the others 0); x itself without
  dropout. Dropout is linear in the weights, so this is also its own pullback."""
  if not tiling.dropout_rate:
    return x_bhqk
  keep_11qk = core.dropout_keep(rng, _positions(tiling, i), _positions(tiling, j), tiling.dropout_rate)
  return core.drop(x_bhqk, keep_11qk, tiling.dropout_rate)


def _tile(tiling: _Tiling, i, j, q_bqhd, k_bkhd, v_bkhd, seg_bt, bias, lse_bhq, rng):
  """Output of query block i from key block j in float32, and (softmax) the block's softmax mass
  Σ_k a_bhqk before dropout, whose gradient a_bhqk is the path through the row's log-sum-exp."""
  knobs = tiling.knobs
  mask = _tile_mask(tiling, i, j, seg_bt)
  s_bhqk = core.masked_scores(q_bqhd, k_bkhd, bias, mask)
  a_bhqk = core.normalize(s_bhqk, mask, normalization=knobs.normalization, lse_bhq=lse_bhq)
  out_bqhd = core.apply_value_network(_dropped(tiling, i, j, rng,
                                               a_bhqk), v_bkhd, value_network=knobs.value_network,
                                      nonlinearity=knobs.nonlinearity).astype(jnp.float32)
  return out_bqhd, (a_bhqk.sum(-1) if lse_bhq is not None else None)


def _hypernetwork_pullback(tiling: _Tiling, i, j, q_bqhd, k_bkhd, v_bkhd, bias, lse_bhq, rng, seg_bt, g_bqhd):
  """_tile's pullback for the hypernetwork value network, written out: automatic differentiation
  transposed the [b, q, k, d] tensors between matmuls batched over queries and over keys, which was
  slower (docs/results/attention_speed.md). Here z, φ'(z) and dz stay key-major; only φ(z) meets a matmul
  batched over queries.

  Returns the tile's weights a_bhqk before dropout, the cotangent da_bhqk the output gives them, dv,
  and the pullback from a's total cotangent to dq, dk and dbias."""
  normalization, nonlinearity = tiling.knobs.normalization, tiling.knobs.nonlinearity
  mask = _tile_mask(tiling, i, j, seg_bt)
  s_bhqk, scores_vjp = jax.vjp(lambda q, k, b: core.masked_scores(q, k, b, mask), q_bqhd, k_bkhd, bias)
  if normalization == "rms_head":
    a_bhqk, r_b1qk = core.rms_head(s_bhqk)
    a_bhqk = a_bhqk if mask is None else jnp.where(mask, a_bhqk, 0.0)
    # a = s·r with r = (mean_h s² + ε)^-½, so ds = r·(da − a·mean_h(a·da)).
    normalize_pullback = lambda da: r_b1qk * (da - a_bhqk * jnp.mean(a_bhqk * da, axis=1, keepdims=True))
  else:
    a_bhqk, vjp = jax.vjp(lambda s: core.normalize(s, mask, normalization=normalization, lse_bhq=lse_bhq),
                          s_bhqk)
    normalize_pullback = lambda da: vjp(da)[0]
  # Matmul inputs in the compute dtype, as in the forward pass; sums accumulate in float32.
  dtype, f32 = v_bkhd.dtype, dict(preferred_element_type=jnp.float32)
  a_c, g_c = _dropped(tiling, i, j, rng, a_bhqk).astype(dtype), g_bqhd.astype(dtype)
  z_bkqd = jnp.einsum("bhqk,bkhd->bkqd", a_c, v_bkhd)
  p_bkqd, phi_pullback = jax.vjp(core.NONLINEARITIES[nonlinearity], z_bkqd)
  dz_bkqd = phi_pullback(jnp.einsum("bhqk,bqhd->bkqd", a_c, g_c))[0]
  da_bhqk = _dropped(
      tiling, i, j, rng,
      jnp.einsum("bqhd,bkqd->bhqk", g_c, p_bkqd, **f32) +
      jnp.einsum("bkqd,bkhd->bhqk", dz_bkqd, v_bkhd, **f32))
  dv_bkhd = jnp.einsum("bhqk,bkqd->bkhd", a_c, dz_bkqd, **f32)
  # dq, dk and dbias from a's total cotangent (masked scores get none).
  scores_pullback = lambda da_bhqk: scores_vjp(normalize_pullback(da_bhqk))
  return a_bhqk, da_bhqk, dv_bkhd, scores_pullback


def _blocks(x: jax.Array, axis: int, index, block: int) -> jax.Array:
  return jax.lax.dynamic_slice_in_dim(x, index * block, block, axis)


def _bias_tile(bias, i, j, block):
  return None if bias is None else _blocks(_blocks(bias, 2, i, block), 3, j, block)


def _over_keys(tiling: _Tiling, i, n, body, init):
  """Loops body over the key blocks query block i sees: up to the diagonal when causal, else all n."""
  return jax.lax.fori_loop(0, i + 1 if tiling.causal else n, body, init)


def _lse(tiling: _Tiling, q, k, seg_bt, bias):
  """Pass one for softmax: each row's log-sum-exp over its allowed keys, [b, h, t], streaming."""
  block = tiling.block
  n = q.shape[1] // block
  neg = jnp.finfo(jnp.float32).min

  def query_block(i):
    q_bqhd = _blocks(q, 1, i, block)

    def body(j, carry):
      m_bhq, l_bhq = carry
      mask = _tile_mask(tiling, i, j, seg_bt)
      s_bhqk = core.masked_scores(q_bqhd, _blocks(k, 1, j, block), _bias_tile(bias, i, j, block), mask)
      if mask is not None:
        s_bhqk = jnp.where(mask, s_bhqk, neg)
      m_new = jnp.maximum(m_bhq, s_bhqk.max(-1))
      e_bhqk = jnp.exp(s_bhqk - m_new[..., None])
      if mask is not None:
        e_bhqk = jnp.where(mask, e_bhqk, 0.0)
      return m_new, l_bhq * jnp.exp(m_bhq - m_new) + e_bhqk.sum(-1)

    shape = (q.shape[0], q.shape[2], block)
    m_bhq, l_bhq = _over_keys(tiling, i, n, body, (jnp.full(shape, neg), jnp.zeros(shape)))
    return m_bhq + jnp.log(l_bhq)

  lse_nbhq = jax.lax.map(query_block, jnp.arange(n))
  return jnp.moveaxis(lse_nbhq, 0, 2).reshape(q.shape[0], q.shape[2], -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blocked(tiling, q, k, v, seg_bt, bias, rng):
  return _forward(tiling, q, k, v, seg_bt, bias, rng)[0]


def _forward(tiling, q, k, v, seg_bt, bias, rng):
  block = tiling.block
  n = q.shape[1] // block
  lse = _lse(tiling, q, k, seg_bt, bias) if tiling.knobs.normalization == "softmax" else None

  def query_block(i):
    q_bqhd = _blocks(q, 1, i, block)
    lse_bhq = None if lse is None else _blocks(lse, 2, i, block)

    def body(j, out_bqhd):
      return out_bqhd + _tile(tiling, i, j, q_bqhd, _blocks(k, 1, j, block), _blocks(v, 1, j, block), seg_bt,
                              _bias_tile(bias, i, j, block), lse_bhq, rng)[0]

    return _over_keys(tiling, i, n, body, jnp.zeros(q_bqhd.shape, jnp.float32))

  out_nbqhd = jax.lax.map(query_block, jnp.arange(n))
  out = jnp.moveaxis(out_nbqhd, 0, 1).reshape(q.shape).astype(q.dtype)
  return out, (q, k, v, seg_bt, bias, lse, rng)


def _backward(tiling, residuals, dout):
  q, k, v, seg_bt, bias, lse, rng = residuals
  block = tiling.block
  n = q.shape[1] // block
  dout = dout.astype(jnp.float32)
  hypernetwork = tiling.knobs.value_network == "hypernetwork"

  def tile_fn(i, j):
    return lambda q_t, k_t, v_t, bias_t, lse_t: _tile(tiling, i, j, q_t, k_t, v_t, seg_bt, bias_t, lse_t, rng)

  def tile_args(i, j):
    return (_blocks(q, 1, i, block), _blocks(k, 1, j, block), _blocks(v, 1, j, block),
            _bias_tile(bias, i, j, block), None if lse is None else _blocks(lse, 2, i, block))

  dlse = None
  if lse is not None:
    # Pass one: each row's cotangent of its log-sum-exp, summed over all its key tiles.
    def dlse_block(i):
      dout_bqhd = _blocks(dout, 1, i, block)

      def body(j, dlse_bhq):
        args = tile_args(i, j)
        if hypernetwork:
          # a = exp(s − lse), so the output's pullback to lse is −Σ_k a·da.
          a_bhqk, da_bhqk, _, _ = _hypernetwork_pullback(tiling, i, j, *args, rng, seg_bt, dout_bqhd)
          return dlse_bhq - (a_bhqk * da_bhqk).sum(-1)
        _, pullback = jax.vjp(lambda lse_t: tile_fn(i, j)(*args[:4], lse_t)[0], args[4])
        return dlse_bhq + pullback(dout_bqhd)[0]

      return _over_keys(tiling, i, n, body, jnp.zeros((q.shape[0], q.shape[2], block)))

    dlse = jnp.moveaxis(jax.lax.map(dlse_block, jnp.arange(n)), 0, 2).reshape(lse.shape)

  def query_block(carry, i):
    dout_bqhd = _blocks(dout, 1, i, block)
    dlse_bhq = None if dlse is None else _blocks(dlse, 2, i, block)

    def body(j, inner):
      dq_bqhd, dk, dv, dbias = inner
      args = tile_args(i, j)
      if hypernetwork:
        _, da_bhqk, dv_t, scores_pullback = _hypernetwork_pullback(tiling, i, j, *args, rng, seg_bt,
                                                                   dout_bqhd)
        # With softmax, the tile's mass Σ_k a_bhqk carries the row's log-sum-exp cotangent.
        dq_t, dk_t, dbias_t = scores_pullback(da_bhqk if dlse is None else da_bhqk + dlse_bhq[..., None])
      else:
        _, pullback = jax.vjp(tile_fn(i, j), *args)
        dq_t, dk_t, dv_t, dbias_t, _ = pullback((dout_bqhd, None if dlse is None else dlse_bhq))
      add = lambda acc, t, axis: jax.lax.dynamic_update_slice_in_dim(acc,
                                                                     _blocks(acc, axis, j, block) + t, j *
                                                                     block, axis)
      if dbias is not None:
        # Each (i, j) tile of the bias is visited once: written, not accumulated.
        dbias = jax.lax.dynamic_update_slice(dbias, dbias_t.astype(dbias.dtype), (0, 0, i * block, j * block))
      return dq_bqhd + dq_t, add(dk, dk_t, 1), add(dv, dv_t, 1), dbias

    dk, dv, dbias = carry
    dq_bqhd, dk, dv, dbias = _over_keys(tiling, i, n, body,
                                        (jnp.zeros(dout_bqhd.shape, jnp.float32), dk, dv, dbias))
    return (dk, dv, dbias), dq_bqhd

  zeros = lambda x: None if x is None else jnp.zeros(x.shape, jnp.float32)
  (dk, dv, dbias), dq_nbqhd = jax.lax.scan(query_block, (zeros(k), zeros(v), zeros(bias)), jnp.arange(n))
  dq = jnp.moveaxis(dq_nbqhd, 0, 1).reshape(q.shape)
  cast = lambda d, x: None if x is None else d.astype(x.dtype)
  return cast(dq, q), cast(dk, k), cast(dv, v), None, cast(dbias, bias), None


_blocked.defvjp(_forward, _backward)
