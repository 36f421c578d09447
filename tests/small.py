"""A small model on the generated test corpus (tests/conftest.py), the compositional configs at a
tiny size, and reading what a run wrote; importable from config files that tests hand to `lm-train`
in a subprocess, so it imports nothing that defines flags."""

import importlib.metadata
import os
import pathlib
import struct
import subprocess
import sys

from etils import epath
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c

from configs import tiny

# XLA's CPU backend compiles without LLVM's optimisations and with its older (non-MLIR) fusion emitters
# in the tests (tests/conftest.py sets this for the test process and, through the environment, the
# processes tests start): most tests compile many small programs and run each a few steps, and
# compiling was most of their time (the older emitters compile about 3x faster; steps run as fast).
# The tests' assertions hold either way, up to float32 rounding; lm-compile's TPU compilation gives
# the same figures with it (checked on configs/c4_50m.py). jaxlib 0.12's XLA has only the newer
# emitters, and the flag would be an unknown one, which stops the process.
_OLD_EMITTERS = tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 12)
FAST_CPU_COMPILE = "--xla_backend_optimization_level=0" + (" --xla_cpu_use_fusion_emitters=false"
                                                           if _OLD_EMITTERS else "")


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a test's subprocess on `devices` CPU devices."""
  return f"{FAST_CPU_COMPILE} --xla_force_host_platform_device_count={devices}"


def python_on_cpu_devices(script: str, devices: int) -> subprocess.CompletedProcess:
  """Python source run in a fresh process on `devices` CPU devices, from the repository's root (a
  process's device count is fixed when JAX starts)."""
  env = dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600,
                        cwd=pathlib.Path(__file__).resolve().parents[1])


# One compilation cache for every test run of the small model, in-process or in a subprocess: tests
# that train it again (resumed, killed, on another workdir) load its programs instead of compiling
# them. Entries are keyed by the program, its flags and JAX's version, so sharing changes no result.
COMPILATION_CACHE = str(pathlib.Path(__file__).resolve().parents[1] / ".pytest_cache" / "jax_compilation")


def small_config(corpus_dir, **model):
  c = tiny.get_config()
  c.model.update(V=320, D=32, H=4, L=2, F=64, **model)
  c.data.update(source="array_record", dir=str(corpus_dir), seq_len=32, packing_bins=8, threads=1)
  c.train.update(steps=40, batch_size=8, lr=1e-2, warmup_steps=5, log_every_steps=10)
  c.eval.update(every_steps=20, batch_size=8)
  c.checkpoint.every_steps = 1000
  c.compilation_cache = COMPILATION_CACHE
  return c


def tiny_compositional(config_module, **model):
  """configs/sraven.py or configs/fuzzy_logic.py (`config_module`) at a size that trains in seconds:
  batches of 8, 30 steps, no attention dropout unless `model` asks for it."""
  c = config_module.get_config()
  c.model.update(**{**dict(D=16, qkv_dim=8, H=4, L=2, F=32, attention_dropout=0.0), **model})
  c.train.update(instances=8 * 30, batch_size=8, lr=3e-3, warmup_steps=3, log_every_steps=10)
  c.eval.update(every_steps=1000, batch_size=16, batches=1, final_batches=2)
  c.checkpoint.every_steps = 1000
  return c.copy_and_resolve_references()


def tensorboard_events(workdir) -> list:
  """Every event in workdir/tensorboard, its TFRecord framing and checksums verified."""
  events = []
  for path in sorted((epath.Path(workdir) / "tensorboard").glob("events.out.tfevents.*")):
    data, at = path.read_bytes(), 0
    while at < len(data):
      header = data[at:at + 8]
      (length,), (header_crc,) = struct.unpack("<Q", header), struct.unpack("<I", data[at + 8:at + 12])
      body = data[at + 12:at + 12 + length]
      (body_crc,) = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
      assert header_crc == masked_crc32c(header) and body_crc == masked_crc32c(body), path
      events.append(event_pb2.Event.FromString(body))
      at += 16 + length
  return events
