"""What one attention layer keeps of the past while decoding token by token (a flax "cache"
collection, as flax's own attention keeps in decode mode), so that each new token's output is exactly
the full forward pass's output at its position.

Per layer (`kind`), with T the cache's length (prompt plus new tokens), H heads of width K:
  - "recurrent": linear attention (normalisation none, value network linear, no position bias). Its
    output is q·Σ_k k vᵀ / sqrt(K), so the state S = Σ_k k_k v_kᵀ ([B, H, K, K], keys rotated at
    their positions) is all of the past it needs: constant memory and O(H·K²) work per token. Gated
    (GLA), the same state decays by each new token's gate: S_t = diag(α_t) S_{t-1} + k_tᵀ v_t.
  - "key_value": every other setting. Softmax couples a query's keys through its normaliser; rms_head
    normalises the heads of each (query, key) pair; the hypernetwork applies φ to a per-pair mixture
    z = Σ_h a_h v_h; and a position bias depends on each pair's distance. None of these is a sum of
    per-key terms independent of the query, so no summary of the past smaller than the keys and values
    themselves is exact: HYLA and its ablations keep the key/value cache ([B, H, T, K] each, keys after
    rotary) and cost O(T·H·K) per token, as softmax does.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm import attention


def kind(knobs: attention.Knobs, position_bias: bool) -> str:
  """"recurrent" or "key_value": the exact decoding state of a layer with these knobs."""
  if (knobs.normalization, knobs.value_network) == ("none", "linear") and not position_bias:
    return "recurrent"
  return "key_value"


class KeyValueCache(nn.Module):
  """Keys and values of `length` positions; new tokens at `positions_bt` (the same in every row)
  are written in place, then attend causally to every filled position through the core."""
  length: int
  knobs: attention.Knobs

  @nn.compact
  def __call__(self, q_bthk, k_bthk, v_bthk, positions_bt, bias_bhqk):
    B, _, H, K = k_bthk.shape
    # Head-major, as the core's per-head products read keys and values: no copy per token.
    k_cache = self.variable("cache", "k_bhtk", jnp.zeros, (B, H, self.length, K), k_bthk.dtype)
    v_cache = self.variable("cache", "v_bhtk", jnp.zeros, (B, H, self.length, K), v_bthk.dtype)
    start = (0, 0, positions_bt[0, 0], 0)
    k_cache.value = jax.lax.dynamic_update_slice(k_cache.value, jnp.swapaxes(k_bthk, 1, 2), start)
    v_cache.value = jax.lax.dynamic_update_slice(v_cache.value, jnp.swapaxes(v_bthk, 1, 2), start)
    # Slots after the newest token hold zeros; causality over the explicit positions masks them.
    return attention.attend(q_bthk, jnp.swapaxes(k_cache.value, 1, 2), jnp.swapaxes(v_cache.value, 1, 2),
                            normalization=self.knobs.normalization, value_network=self.knobs.value_network,
                            nonlinearity=self.knobs.nonlinearity, causal=True, bias=bias_bhqk, impl="auto",
                            positions=(positions_bt[0], jnp.arange(self.length)))


class RecurrentState(nn.Module):
  """Linear attention's state S = Σ k vᵀ per head, in float32. New tokens attend among themselves
  causally (the core's chunked kernel) and read S for everything before them. log_gate_bthk (GLA):
  log α of the new tokens; S decays by their gates, and each new query reads S decayed up to it."""

  @nn.compact
  def __call__(self, q_bthk, k_bthk, v_bthk, log_gate_bthk=None):
    B, _, H, K = k_bthk.shape
    s_bhkk = self.variable("cache", "s_bhkk", jnp.zeros, (B, H, K, K), jnp.float32)
    f32 = dict(preferred_element_type=jnp.float32)
    within_bthk = attention.attend(q_bthk, k_bthk, v_bthk, normalization="none", value_network="linear",
                                   causal=True, impl="auto", log_gate=log_gate_bthk)
    # Gated: each new query reads S decayed by the gates from the first new token through its own, and S
    # moves on by all of them (every exponent ≤ 0). Ungated, α = 1.
    g_bthk = jnp.zeros(q_bthk.shape, jnp.float32) if log_gate_bthk is None else jnp.cumsum(
        log_gate_bthk.astype(jnp.float32), axis=1)
    # The core's score scale, 1 / sqrt(K).
    past_bthk = jnp.einsum("bthk,bhkj->bthj", q_bthk * jnp.exp(g_bthk), s_bhkk.value, **f32) * K**-0.5
    s_bhkk.value = jnp.exp(g_bthk[:, -1])[..., None] * s_bhkk.value + jnp.einsum(
        "bthk,bthj->bhkj", k_bthk * jnp.exp(g_bthk[:, -1:] - g_bthk), v_bthk, **f32)
    return (within_bthk + past_bthk).astype(q_bthk.dtype)
