"""Softmax attention (normalization softmax, value network linear) through fused kernels.

dot_product: jax.nn.dot_product_attention with implementation=None, so XLA picks cuDNN's flash attention
on GPU when the shapes allow and its own fusion elsewhere. pallas: the Pallas TPU flash attention kernel,
which tiles sequences in blocks of 128. auto: on TPU the Pallas kernel when the length tiles; on CPU the
blocked kernel from CPU_BLOCKED_FROM tokens on (measured faster there than XLA's, and memory-linear, by
benchmarks/attention.py); dot_product otherwise. The platform is the one being lowered for
(lax.platform_dependent), so a train step compiled ahead of time for a TPU topology on a CPU host gets the
TPU kernel.
"""

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash
from jax.sharding import PartitionSpec as P

from lm import attention_blocked, sharding

PALLAS_BLOCK = 128
CPU_BLOCKED_FROM = 1024


def attend_softmax(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                   segment_ids: jax.Array | None = None, bias: jax.Array | None = None,
                   impl: str = "auto") -> jax.Array:
  """Same contract as lm.attention.attend with normalization softmax and value network linear."""
  bias = None if bias is None else bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
  args = (q, k, v, causal, segment_ids, bias)
  if impl == "dot_product":
    return _dot_product(*args)
  fits = q.shape[1] % PALLAS_BLOCK == 0 and k.shape[1] % PALLAS_BLOCK == 0
  if impl == "pallas":
    if not fits:
      raise ValueError(f"attention impl 'pallas' tiles sequences in blocks of {PALLAS_BLOCK}, got lengths "
                       f"{q.shape[1]} and {k.shape[1]}; use a multiple of {PALLAS_BLOCK} or impl 'auto'")
    return _pallas(*args)
  per_platform = {}
  if fits:
    per_platform["tpu"] = lambda *qkv: _pallas(*qkv, *args[3:])
  if q.shape[1] >= CPU_BLOCKED_FROM:
    per_platform["cpu"] = lambda *qkv: attention_blocked.attend_blocked(
        *qkv, normalization="softmax", value_network="linear", causal=causal, segment_ids=segment_ids,
        bias=bias)
  if not per_platform:
    return _dot_product(*args)
  return jax.lax.platform_dependent(q, k, v, default=lambda *qkv: _dot_product(*qkv, *args[3:]),
                                    **per_platform)


def _dot_product(q, k, v, causal, segment_ids, bias):
  mask = None
  if segment_ids is not None:
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
  return jax.nn.dot_product_attention(q, k, v, bias=None if bias is None else bias.astype(q.dtype),
                                      mask=mask, is_causal=causal)


def _pallas(q, k, v, causal, segment_ids, bias):
  """The kernel on each device's shard: Mosaic kernels are not partitioned automatically, so under a
  mesh it runs in a shard_map over the batch (data, fsdp) and head (tensor) axes."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return _pallas_local(q, k, v, causal, segment_ids, bias)
  batch = tuple(a for a in sharding.BATCH if a in mesh.axis_names)
  heads = "tensor" if "tensor" in mesh.axis_names and q.shape[2] % mesh.shape["tensor"] == 0 else None
  qkv_spec = P(batch, None, heads, None)
  bias_spec = None if bias is None else P(batch if bias.shape[0] > 1 else None,
                                          heads if bias.shape[1] > 1 else None, None, None)
  # check_vma off: the kernel declares its outputs without per-axis variance annotations.
  return jax.shard_map(
      lambda q, k, v, seg, bias: _pallas_local(q, k, v, causal, seg, bias),
      in_specs=(qkv_spec, qkv_spec, qkv_spec, None if segment_ids is None else P(batch, None), bias_spec),
      out_specs=qkv_spec, check_vma=False)(q, k, v, segment_ids, bias)


def _pallas_local(q, k, v, causal, segment_ids, bias):
  B, T, H, _ = q.shape
  q_bhtd, k_bhtd, v_bhtd = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
  if bias is not None:
    bias = jnp.broadcast_to(bias, (B, H, T, k.shape[1])).astype(jnp.float32)
  segments = None if segment_ids is None else pallas_flash.SegmentIds(q=segment_ids, kv=segment_ids)
  out_bhtd = pallas_flash.flash_attention(q_bhtd, k_bhtd, v_bhtd, bias, segments, causal=causal,
                                          sm_scale=q.shape[-1] ** -0.5)
  return jnp.swapaxes(out_bhtd, 1, 2)
