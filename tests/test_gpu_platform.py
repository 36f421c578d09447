"""The GPU's platform choices, on CPU: XLA options set for one platform stay on it, and a host with a
GPU plugin keeps JAX's own platform order."""

import importlib.metadata
import types

import pytest

from lm import xla_options
from lm.runtime import cli


@pytest.mark.parametrize("platform,devices,want", [
    ("gpu", 8, {
        "xla_gpu_enable_latency_hiding_scheduler": "true"
    }),
    ("gpu", 1, {}),
    ("cpu", 8, {}),
    ("tpu", 16, {}),
])
def test_the_latency_hiding_scheduler_is_set_on_several_gpus_only(platform, devices, want):
  assert xla_options.gpu_compiler_options(platform, devices) == want


def test_cpu_options_stay_on_cpu():
  assert xla_options.cpu_compiler_options("dot,eltwise", "cpu")
  assert xla_options.cpu_compiler_options("dot,eltwise", "gpu") is None
  assert xla_options.microbatch_compiler_options(4, "cpu", None) == {}
  common, train = xla_options.step_options("dot", 1, "gpu", 4)
  assert common == train == {"xla_gpu_enable_latency_hiding_scheduler": "true"}
  assert xla_options.step_options("dot", 1, "cpu", 4)[0] == xla_options.cpu_compiler_options("dot", "cpu")


class _Dist:

  def __init__(self, name):
    self.metadata = {"Name": name}


@pytest.mark.parametrize("installed,chosen", [
    (["jax", "jax-cuda12-plugin"], None),
    (["jax", "jax_cuda13_plugin"], None),
    (["jax", "libtpu"], "cpu"),
])
def test_a_host_without_tpu_chips_keeps_its_gpus(installed, chosen, monkeypatch):
  updates = {}
  config = types.SimpleNamespace(jax_platforms="",
                                 update=lambda name, value: updates.__setitem__(name, value))
  monkeypatch.setattr(cli, "jax", types.SimpleNamespace(config=config))
  monkeypatch.setattr(cli.hardware_utils, "num_available_tpu_chips_and_device_id", lambda: (0, None))
  monkeypatch.setattr(importlib.metadata, "distributions", lambda: [_Dist(n) for n in installed])
  cli.choose_platform()
  assert updates.get("jax_platforms") == chosen
