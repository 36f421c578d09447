"""Gated linear attention (GLA, Yang et al. 2024): normalisation none, value network linear, scores
gated by a data-dependent decay α_t ∈ (0, 1)^d per head, given as log α (lm/model.py makes it).

Per head, with the core's score scale 1/sqrt(d) and S_0 = 0:
    S_t = diag(α_t) S_{t-1} + k_tᵀ v_t        ([d, d]: keys' dimension decays, values' does not)
    o_t = q_t S_t / sqrt(d)
which is attention_core.reference with the decayed scores s_qk = Σ_d q_qd k_kd Π_{k<r≤q} α_rd / sqrt(d).
A packed document starts from S = 0: the state resets where the segment id changes (segment ids must
be contiguous runs, as packing makes them). Causal only; no position bias, no dropout.

attend_recurrent is the recurrence itself, one step per token in a lax.scan: the ground truth of the
other two forms and what decoding runs. attend_chunked is the training form, O(t·C·d + t·d²): within
a chunk of C tokens the decayed [C, C] scores are formed from the [C, C, d] decay (every exponent ≤ 0,
so nothing overflows however small α gets); across chunks the state carries the rest, decayed by the
chunk's total gate. attention_core.reference is the quadratic definition.
"""

import jax
import jax.numpy as jnp

CHUNK = 16  # the [C, C, d] decay per chunk is C times q's size: small chunks keep it so


def _segments(segment_ids: jax.Array | None, B: int, T: int) -> jax.Array:
  return jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)


def _gate(log_gate: jax.Array | None, like: jax.Array) -> jax.Array:
  """log α in float32; none given is α = 1 (plain linear attention)."""
  return jnp.zeros(like.shape, jnp.float32) if log_gate is None else log_gate.astype(jnp.float32)


def attend_recurrent(q: jax.Array, k: jax.Array, v: jax.Array, *, log_gate: jax.Array | None = None,
                     segment_ids: jax.Array | None = None) -> jax.Array:
  """The recurrence step by step: q, k, v, log_gate [B, T, H, d] → out [B, T, H, d]."""
  B, T, H, K = q.shape
  seg_bt = _segments(segment_ids, B, T)
  # A token whose segment differs from the previous token's starts from an empty state.
  start_bt = jnp.concatenate([jnp.ones((B, 1), bool), seg_bt[:, 1:] != seg_bt[:, :-1]], axis=1)

  def step(s_bhde, inputs):
    q_bhd, k_bhd, v_bhd, log_gate_bhd, start_b = inputs
    s_bhde = jnp.where(start_b[:, None, None, None], 0.0, s_bhde)
    s_bhde = jnp.exp(log_gate_bhd)[..., None] * s_bhde + k_bhd[..., :, None] * v_bhd[..., None, :]
    return s_bhde, jnp.einsum("bhd,bhde->bhe", q_bhd, s_bhde) * K**-0.5

  f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)  # time first, for the scan
  _, out_tbhd = jax.lax.scan(step, jnp.zeros((B, H, K, K), jnp.float32),
                             (f32(q), f32(k), f32(v), f32(_gate(log_gate, q)), jnp.moveaxis(start_bt, 1, 0)))
  return jnp.moveaxis(out_tbhd, 0, 1).astype(q.dtype)


def attend_chunked(q: jax.Array, k: jax.Array, v: jax.Array, *, log_gate: jax.Array | None = None,
                   segment_ids: jax.Array | None = None, chunk: int = CHUNK) -> jax.Array:
  """The recurrence's result in chunks of `chunk` tokens: exact within a chunk, recurrent across."""
  B, T, H, K = q.shape
  C = min(chunk, T)
  N = -(-T // C)
  # Padding goes after every real token, so causality already hides it from them.
  pad = ((0, 0), (0, N * C - T), (0, 0), (0, 0))
  q_bnchd, k_bnchd, v_bnchd = (jnp.pad(x.astype(jnp.float32), pad).reshape(B, N, C, H, K) for x in (q, k, v))
  # Cumulative log gate within each chunk, inclusive: g_c = Σ_{r≤c} log α_r.
  g_bnchd = jnp.cumsum(jnp.pad(_gate(log_gate, q), pad).reshape(B, N, C, H, K), axis=2)
  seg_bnc = jnp.pad(_segments(segment_ids, B, T), ((0, 0), (0, N * C - T)),
                    constant_values=-1).reshape(B, N, C)
  q_bnchd = q_bnchd * K**-0.5

  # Within a chunk: the decayed scores, from the decay of each (query, key) pair and dimension.
  causal_qk = jnp.tril(jnp.ones((C, C), bool))
  mask_bnqk = causal_qk & (seg_bnc[:, :, :, None] == seg_bnc[:, :, None, :])
  diff_bnqkhd = g_bnchd[:, :, :, None] - g_bnchd[:, :, None, :]
  decay_bnqkhd = jnp.exp(jnp.where(causal_qk[:, :, None, None], diff_bnqkhd, -jnp.inf))
  s_bnhqk = jnp.einsum("bnqhd,bnkhd,bnqkhd->bnhqk", q_bnchd, k_bnchd, decay_bnqkhd)
  s_bnhqk = jnp.where(mask_bnqk[:, :, None], s_bnhqk, 0.0)
  intra_bnqhd = jnp.einsum("bnhqk,bnkhd->bnqhd", s_bnhqk, v_bnchd)

  # Across chunks: chunk n adds its last segment's keys, decayed to its end, to the state it carries
  # on decayed by its whole gate; a chunk that starts a new segment carries nothing from before.
  last_bn = seg_bnc[:, :, -1]
  prev_bn = jnp.pad(last_bn[:, :-1], ((0, 0), (1, 0)), constant_values=-2)
  g_end_bnhd = g_bnchd[:, :, -1]
  to_end_bnchd = jnp.exp(g_end_bnhd[:, :, None] - g_bnchd)
  keep_bnc = seg_bnc == last_bn[:, :, None]
  kv_bnhde = jnp.einsum("bnkhd,bnkhe->bnhde", jnp.where(keep_bnc[..., None, None], k_bnchd * to_end_bnchd, 0),
                        v_bnchd)
  carry_bnhd = jnp.where((last_bn == prev_bn)[:, :, None, None], jnp.exp(g_end_bnhd), 0.0)

  def combine(earlier, later):
    # S ↦ a S + s composed: first `earlier`, then `later`.
    a_e, s_e = earlier
    a_l, s_l = later
    return a_l * a_e, a_l[..., None] * s_e + s_l

  _, state_bnhde = jax.lax.associative_scan(combine, (carry_bnhd, kv_bnhde), axis=1)
  # Chunk n reads the state after chunk n-1, decayed to each query, if the query continues its segment.
  state_bnhde = jnp.pad(state_bnhde[:, :-1], ((0, 0), (1, 0), (0, 0), (0, 0), (0, 0)))
  reads_bnc = seg_bnc == prev_bn[:, :, None]
  q_decayed_bnchd = jnp.where(reads_bnc[..., None, None], q_bnchd * jnp.exp(g_bnchd), 0.0)
  inter_bnqhd = jnp.einsum("bnqhd,bnhde->bnqhe", q_decayed_bnchd, state_bnhde)
  return (intra_bnqhd + inter_bnqhd).reshape(B, N * C, H, K)[:, :T].astype(q.dtype)
