"""Softmax attention (normalization softmax, value network linear) through fused kernels.

dot_product: jax.nn.dot_product_attention with implementation=None, which is XLA's own form on every
platform (the [T, T] scores materialised). cudnn: the same function with implementation="cudnn",
cuDNN's fused flash attention (GPU only; bfloat16 or float16, head width a multiple of 8 up to 128, no
mask tensor, so no packed-document segments). pallas_gpu: jax's Pallas GPU (Triton) flash attention,
which takes segment ids and tiles sequences in blocks of 128. pallas: the Pallas TPU flash attention kernel,
which tiles sequences in blocks of 128 and takes an additive bias. splash: the Pallas TPU splash
attention kernel (no bias), which keeps one log-sum-exp per query where flash attention keeps its row
statistics broadcast over 128 lanes, and computes dq, dk and dv in one backward kernel: less HBM
traffic on a v5e chip for configs/c4_50m.py (docs/results/compile_v5e.md). None
applies attention dropout. Which one runs where is lm/attention/__init__.py's table.
"""

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash,
    splash_attention_mask as splash_mask,
)

from lm.attention import core

PALLAS_BLOCK = 128
# What cuDNN's flash attention takes through jax.nn.dot_product_attention (jax/_src/cudnn's
# check_layout and check_is_flash_attention): fp16/bf16, a head width that is a multiple of 8 and at
# most 128 (256 on Hopper and later; 128 holds on every GPU).
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_HEAD_MULTIPLE, CUDNN_MAX_HEAD = 8, 128
SPLASH_MAX_BLOCK = 512
# The prefixes of the splash kernels' names (the library's), as the TPU compiler's dumps carry them.
SPLASH_FORWARD, SPLASH_BACKWARD = "splash_mha_fwd", "splash_mha_dkv"


def _bias_4d(bias: jax.Array | None) -> jax.Array | None:
  return None if bias is None else bias.reshape((1,) * (4 - bias.ndim) + bias.shape)


def attend_dot_product(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                       segment_ids: jax.Array | None = None, bias: jax.Array | None = None) -> jax.Array:
  """core.reference's contract for softmax attention without dropout."""
  mask = None
  if segment_ids is not None:
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
  bias = _bias_4d(bias)
  return jax.nn.dot_product_attention(q, k, v, bias=None if bias is None else bias.astype(q.dtype), mask=mask,
                                      is_causal=causal)


def attend_cudnn(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True) -> jax.Array:
  """attention_core.reference's contract for softmax attention without segments, bias or dropout, on
  GPU, inputs in CUDNN_DTYPES; cuDNN skips the masked blocks of a causal call."""
  if jax.default_backend() != "gpu":
    raise ValueError(f"attention impl 'cudnn' runs on GPU only, not {jax.default_backend()}; use impl 'auto'")
  return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


def attend_pallas_gpu(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                      segment_ids: jax.Array | None = None, batch_axes: tuple[str, ...] = (),
                      interpret: bool = False) -> jax.Array:
  """attention_core.reference's contract for softmax attention without bias or dropout, lengths a
  multiple of PALLAS_BLOCK, through jax's Pallas GPU flash attention on each device's shard
  (core.per_device). interpret: Pallas's interpreter (any backend)."""
  # Imported here: the Triton lowering is GPU-only, and CPU and TPU runs never trace this function.
  from jax.experimental.pallas.ops.gpu import attention as pallas_gpu  # pylint: disable=import-outside-toplevel
  local = lambda q, k, v, seg, _: pallas_gpu.mha(q, k, v, seg, sm_scale=q.shape[-1]**-0.5, causal=causal,
                                                 interpret=interpret)
  return core.per_device(local, q, k, v, segment_ids, None, batch_axes)


def attend_pallas(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                  segment_ids: jax.Array | None = None, bias: jax.Array | None = None,
                  batch_axes: tuple[str, ...] = ()) -> jax.Array:
  """core.reference's contract for softmax attention without dropout, lengths a multiple of
  PALLAS_BLOCK, on each device's shard (core.per_device)."""
  local = lambda q, k, v, seg, bias: _pallas_local(q, k, v, causal, seg, bias)
  return core.per_device(local, q, k, v, segment_ids, _bias_4d(bias), batch_axes)


def attend_splash(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                  segment_ids: jax.Array | None = None, batch_axes: tuple[str, ...] = (),
                  interpret: bool = False) -> jax.Array:
  """core.reference's contract for softmax attention without bias or dropout, lengths a
  multiple of PALLAS_BLOCK; per device as attend_pallas. interpret: Pallas's interpreter (any backend)."""
  local = lambda q, k, v, seg, _: _splash_local(q, k, v, seg, causal, interpret)
  return core.per_device(local, q, k, v, segment_ids, None, batch_axes)


def splash_block(T: int) -> int:
  """The splash kernels' square blocks for length T: the largest of 512, 256, 128 that divides it."""
  return next(b for b in (SPLASH_MAX_BLOCK, 256, PALLAS_BLOCK) if T % b == 0)


def splash_visible_blocks(T: int, causal: bool) -> int:
  """How many (query block, key block) pairs of one head and row the splash kernels compute: those
  with a visible key (the rest of the grid's steps skip their work)."""
  block = splash_block(T)
  return core.visible_blocks(T, block, block, causal)


def _splash_kernel(T: int, H: int, causal: bool, interpret: bool):
  # Made afresh in every trace: the kernel holds arrays of its mask's block structure, and a kernel
  # cached across traces would carry one trace's values into another.
  block = splash_block(T)
  mask = splash_mask.MultiHeadMask([(splash_mask.CausalMask if causal else splash_mask.FullMask)((T, T))] * H)
  blocks = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                             block_kv_dkv=block, block_kv_dkv_compute=block, use_fused_bwd_kernel=True)
  return splash.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret)


def _splash_local(q, k, v, segment_ids, causal, interpret):
  _, T, H, K = q.shape
  kernel = _splash_kernel(T, H, causal, interpret)
  # The kernel has no softmax scale of its own: the queries carry it.
  q_bhtd, k_bhtd, v_bhtd = (jnp.swapaxes(x, 1, 2) for x in (q * K**-0.5, k, v))
  if segment_ids is None:
    out_bhtd = jax.vmap(kernel)(q_bhtd, k_bhtd, v_bhtd)
  else:
    out_bhtd = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(q=s, kv=s)))(
        q_bhtd, k_bhtd, v_bhtd, segment_ids)
  return jnp.swapaxes(out_bhtd, 1, 2)


def _pallas_local(q, k, v, causal, segment_ids, bias):
  B, T, H, _ = q.shape
  q_bhtd, k_bhtd, v_bhtd = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
  if bias is not None:
    bias = jnp.broadcast_to(bias, (B, H, T, k.shape[1])).astype(jnp.float32)
  segments = None if segment_ids is None else pallas_flash.SegmentIds(q=segment_ids, kv=segment_ids)
  out_bhtd = pallas_flash.flash_attention(q_bhtd, k_bhtd, v_bhtd, bias, segments, causal=causal,
                                          sm_scale=q.shape[-1]**-0.5)
  return jnp.swapaxes(out_bhtd, 1, 2)
