"""The TPU chips and topologies lm-compile knows, and libtpu's compile-only devices for a topology."""

import dataclasses
import importlib.util
import os

import jax
from jax.experimental import topologies

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  hbm_bytes: int
  hbm_bytes_per_second: float  # peak FLOP/s are lm.flops.PEAK_FLOPS, which MFU uses too
  clock_hz: float  # one VLIW bundle per cycle: turns the compiler's schedule of a Pallas kernel into time


# Per chip, HBM from Cloud TPU's system-architecture pages; keyed by the devices' device_kind. The clock
# is the one the MXUs' peak implies (v5e: 197 TFLOP/s over four 128 x 128 arrays, 1.5 GHz; v5p and
# v6e: 1.75 GHz).
CHIPS = {
    "TPU v5 lite": Chip(16 * GiB, 819e9, 1.5e9),
    "TPU v5": Chip(95 * GiB, 2765e9, 1.75e9),
    "TPU v6 lite": Chip(32 * GiB, 1640e9, 1.75e9)
}
# Topologies libtpu accepts here (tests/test_compile.py checks every one), for the error message.
EXAMPLES = {
    "v5e": ["2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"],
    "v5p": ["2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8"],
    "v6e": ["2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"]
}


class UsageError(Exception):
  """A mistake in the command line; the message names the fix."""


def valid_topologies() -> str:
  return "; ".join(f"{chip}:{{{','.join(shapes)}}}" for chip, shapes in EXAMPLES.items())


def topology_devices(name: str) -> list:
  """libtpu's compile-only devices of a topology: they compile but never run."""
  if importlib.util.find_spec("libtpu") is None:
    raise UsageError("lm-compile needs libtpu to compile for TPU: pip install -e '.[tpu]'")
  # The lock stops two processes from driving the same chips; compiling drives none, and a test
  # suite or a second lm-compile may hold it.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  if name.split(":")[0] not in EXAMPLES:
    raise UsageError(f"unknown topology {name!r}; choose one of: {valid_topologies()}")
  try:
    return topologies.get_topology_desc(name, "tpu").devices
  except jax.errors.JaxRuntimeError as e:
    raise UsageError(f"libtpu rejects topology {name!r} ({str(e).strip()}); choose one of: "
                     f"{valid_topologies()}") from e
