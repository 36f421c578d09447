"""Model FLOPs per token and device peaks, for MFU."""

import time

import jax
import jax.numpy as jnp

from lm.attention import core as attention_core
from lm.model import ModelConfig

# Dense bf16 peak FLOP/s per chip, from the vendors' spec sheets.
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5": 459e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    # GPUs by the prefix of the device_kind JAX reports ("NVIDIA H100 80GB HBM3", "NVIDIA H200",
    # "NVIDIA A100-SXM4-80GB"); the longest matching prefix wins, so the PCIe and NVL parts get theirs.
    "NVIDIA H100": 989e12,
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA GH200": 989e12,
    "NVIDIA A100": 312e12,
}


def flops_per_token(cfg: ModelConfig, num_params: int, seq_len: int, readout_last: int = 0) -> float:
  """Training FLOPs (forward + backward) per token: 6 per parameter plus the attention core, 3x its
  forward FLOPs per (query, key) pair and layer (lm.attention.core.pair_flops of the layer's preset: the
  score and the value network's products, so HYLA's core costs 1.5x softmax's). Counted over all T keys, as PaLM's MFU convention
  does, whatever the mask skips. readout_last > 0 (a task that reads only the last positions): the last
  layer's query and output projections, MLP, readout and queries run on those rows only (lm/model.py)."""
  # The input embedding is a lookup, not a matmul (unless tied: then it is also the output layer).
  embedding = cfg.V * cfg.D if not (cfg.input_dim or cfg.tied_embeddings) else 0
  width = cfg.qkv_dim or cfg.D
  pair = [attention_core.pair_flops(cfg.layer_knobs(layer), width) for layer in range(cfg.L)]
  total = 6 * (num_params - embedding) + 3 * seq_len * sum(pair)
  if readout_last:
    skipped_rows = (seq_len - readout_last) / seq_len
    row_params = 2 * cfg.D * width + 2 * cfg.D * cfg.F + cfg.D * cfg.V  # wq, wo; the MLP; the readout
    total -= skipped_rows * (6 * row_params + 3 * seq_len * pair[-1])
  return total


def measured_cpu_peak(seconds: float = 0.5) -> float:
  """FLOP/s of a large float32 matmul on this host right now: the only honest CPU 'peak'."""
  n = 1024
  a = jnp.ones((n, n), jnp.float32)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  runs, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    matmul(a).block_until_ready()
    runs += 1
  return 2 * n**3 * runs / (time.perf_counter() - start)


def peak_flops(devices) -> float | None:
  """Summed peak of the devices, from the table or (CPU) measured; None when unknown."""
  kind = devices[0].device_kind
  if devices[0].platform == "cpu":
    # Simulated CPU devices share the host's cores: the host's peak is the peak of them all.
    return measured_cpu_peak()
  peak = next((v for k, v in sorted(PEAK_FLOPS.items(), key=lambda kv: -len(kv[0])) if kind.startswith(k)),
              None)
  return None if peak is None else peak * len(devices)
