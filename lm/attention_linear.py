"""Causal linear attention (normalization none, value network linear) in chunks: O(t·d²) work.

out_q = Σ_{k ≤ q, same segment} (q·k / sqrt(d)) v_k. Within a chunk of C tokens the masked [C, C] scores
are used directly; across chunks, a running state S = Σ_k k vᵀ ([heads, d, d]) carries everything before
the chunk. Segments reset the state: a chunk's state keeps only keys of its last token's segment, and a
query reads the state only when it belongs to that segment. Segment ids must therefore be contiguous runs
(as packing produces), which is what a causal packed batch is.
"""

import jax
import jax.numpy as jnp

CHUNK = 64


def attend_chunked(q: jax.Array, k: jax.Array, v: jax.Array, *, segment_ids: jax.Array | None = None,
                   chunk: int = CHUNK) -> jax.Array:
  """attention_core.reference's contract with normalization none, value network linear, causal, no
  bias and no dropout (lm/attention.py's table holds these limits)."""
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
