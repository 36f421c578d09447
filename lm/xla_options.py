"""The XLA compiler options a run's jitted steps take, per platform.

On CPU, which operations XLA hands to the YNNPACK library (config.cpu_library_fusion). On several
GPUs, the latency-hiding scheduler. On an
accelerator, the pass that a libtpu before FIXED_LIBTPU (and XLA's GPU compiler, which cannot be
checked here) runs wrongly on the train step's microbatch loop is turned off.
"""

import importlib.metadata
import re

# The kinds of operations XLA's CPU backend may hand to YNNPACK (config.cpu_library_fusion).
LIBRARY_FUSIONS = ("dot", "eltwise", "reduce")

# libtpu before 0.0.50 moves the gradient all-reduce out of the microbatch loop (XLA's
# while-loop-all-reduce-code-motion) even where the loop zeroes the accumulated embedding gradient on
# all but one device of the all-reduce group, which is how SPMD partitions the gradient of the
# embedding's gather: the other devices then keep only their last microbatch (openxla/xla#49143).
# tests/test_compile.py finds it in libtpu 0.0.42.1's compiled train step, not in 0.0.50.1's, which
# keeps that all-reduce in the loop (docs/reference/faults.md). XLA's GPU compiler runs the same pass and
# cannot be checked here, so GPUs run without it; XLA's CPU compiler does not run it.
FIXED_LIBTPU = (0, 0, 50)


def cpu_compiler_options(kinds: str, platform: str) -> dict[str, str] | None:
  """The XLA options of the train and eval steps: config.cpu_library_fusion, on CPU only."""
  names = [k.strip() for k in kinds.split(",") if k.strip()]
  unknown = set(names) - set(LIBRARY_FUSIONS)
  if unknown:
    raise ValueError(f"unknown cpu_library_fusion kind(s) {', '.join(sorted(unknown))}; choose from "
                     f"{', '.join(LIBRARY_FUSIONS)}, comma-separated, or \"\" for XLA's default")
  if platform != "cpu" or not names:
    return None
  return {"xla_cpu_experimental_ynn_fusion_type": ",".join(f"LIBRARY_FUSION_TYPE_{n.upper()}" for n in names)}


def gpu_compiler_options(platform: str, devices: int) -> dict[str, str]:
  """The XLA options of the steps on GPU: with several GPUs, the latency-hiding scheduler, which
  overlaps the gradients' all-reduce (and FSDP's gathers) with the backward pass's compute."""
  if platform != "gpu" or devices < 2:
    return {}
  return {"xla_gpu_enable_latency_hiding_scheduler": "true"}


def libtpu_version() -> str | None:
  """The installed libtpu's version, or None when there is none."""
  try:
    return importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    return None


def microbatch_compiler_options(microbatches: int, platform: str, libtpu: str | None) -> dict[str, str]:
  """The XLA options the train step needs for its microbatch loop to sum gradients correctly: on an
  accelerator, without the pass that miscompiles it, unless a libtpu of FIXED_LIBTPU or later says
  otherwise."""
  if microbatches == 1 or platform == "cpu":
    return {}
  if platform == "tpu" and libtpu and tuple(int(n) for n in re.findall(r"\d+", libtpu)[:3]) >= FIXED_LIBTPU:
    return {}
  return {"xla_disable_hlo_passes": "while-loop-all-reduce-code-motion"}


def step_options(cpu_library_fusion: str, microbatches: int, platform: str,
                 devices: int) -> tuple[dict[str, str] | None, dict[str, str] | None]:
  """The XLA options of the eval step and of the train step (None: XLA's defaults)."""
  common = {
      **(cpu_compiler_options(cpu_library_fusion, platform) or {}),
      **gpu_compiler_options(platform, devices)
  } or None
  micro = microbatch_compiler_options(microbatches, platform, libtpu_version() if platform == "tpu" else None)
  return common, {**(common or {}), **micro} or None
