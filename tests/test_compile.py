"""lm-compile: the real train step compiled for a v5e-16 slice (v5e:4x4) on this CPU host.

The c4_50m model is cut to one layer and 16 rows (one per chip) so that each compile takes seconds;
the topology, width, heads, vocabulary, sequence length and sharding stay the real run's.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.experimental import pallas as pl

pytest.importorskip(
    "libtpu", reason="libtpu is not installed (pip install -e '.[tpu]'): "
    "lm-compile cannot compile for TPU here")

from small import small_config  # noqa: E402

from configs import c4_50m, sraven, tiny  # noqa: E402
from data_pipelines import pipeline  # noqa: E402
from launch.aot import compile as compile_lib, kernel_schedule, topology  # noqa: E402
from lm import attention, cross_entropy  # noqa: E402
from lm.attention import hypernetwork, linear, softmax  # noqa: E402
from lm.experiment import Experiment  # noqa: E402
from lm.xla_options import microbatch_compiler_options  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--config.model.L=1", "--config.train.batch_size=16"]


def lm_compile(*argv: str) -> subprocess.CompletedProcess:
  # c4_50m's data.dir is on gs://, which lm-compile never reads: storage that cannot be reached (a
  # closed port here) must not stop it.
  env = dict(os.environ, STORAGE_EMULATOR_HOST="http://127.0.0.1:9")
  return subprocess.run([sys.executable, "-m", "launch.aot.compile", "--config=configs/c4_50m.py", *argv],
                        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["softmax", "hyla"])
def test_compiles_c4_50m_for_v5e_4x4(preset):
  result = lm_compile("--topology=v5e:4x4", f"--config.model.attention={preset}", *SMALL, "--json")
  assert result.returncode == 0, result.stderr[-3000:]
  r = json.loads(result.stdout)
  assert (r["chips"], r["hosts"], r["device_kind"], r["fits"]) == (16, 4, "TPU v5 lite", True)
  assert r["mesh"] == {"data": 16, "fsdp": 1, "tensor": 1}
  # The compiler's argument buffers are what the shardings say, up to its padding (small shards fill
  # whole tiles of 8 x 128): the state split over the 16 chips (mesh.shard_state_over_data: parameters
  # and two Adam moments in float32, a sixteenth of each on a chip, and a few scalars) and one row of
  # 5 fields of 4 bytes.
  config = c4_50m.get_config()
  config.model.update(L=1, attention=preset)
  config.train.batch_size = 16
  exp = Experiment(config, devices=compile_lib.topology_devices("v5e:4x4"))
  assert r["num_params"] == exp.num_params
  state = sum(
      math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
      for x in jax.tree.leaves(exp.abstract_sharded_state()))
  assert 3 * 4 * exp.num_params / 16 <= state < 3 * 4 * exp.num_params / 16 + 2**10
  assert 0 <= r["argument_bytes"] - state - 5 * 4 * 512 < 2**20
  # The compiler's peak holds at least the arguments (live when the step starts). With the state in
  # shards it is not arguments plus temporaries: the donated shards die once gathered, and the
  # compiler's peak and its temporary allocation are counted differently (either can be the larger).
  assert r["argument_bytes"] <= r["total_bytes"] < r["hbm_bytes"] == 16 * 2**30
  # The compiler and the model agree on the step's FLOPs within the attention core's share.
  assert 0.8 < r["compiler_flops"] / r["model_flops"] < 1.25
  # The attention's Pallas kernels add their time, each the longer of the compiler's schedule and its
  # own HBM traffic, and what they declare leaves the rest of the step's roofline: HYLA's (one layer,
  # one row per chip: every causally visible tile of 512 tokens once), or softmax's splash kernels (one
  # block of 512 per head, 8 heads), which declare nothing.
  assert r["clock_hz"] == 1.5e9
  (schedule,) = r["kernel_schedules"]
  # The step's batches pack documents, so the kernels are compiled masking by their segment ids.
  knobs = attention.Knobs(**attention.preset(preset))
  assert schedule["layers"] == 1 and attention.Knobs(**schedule["knobs"]) == knobs and schedule["segments"]
  if preset == "hyla":
    # At 512 tokens, z kept for the backward pass: its 10 tiles of 128 x 128 x 64 in bfloat16, written
    # and read once, are part of the kernels' declared traffic.
    assert schedule["impl"] == r["attention_impls"][0] == "pallas_hypernetwork_keep_z"
    names = (hypernetwork.FORWARD, hypernetwork.BACKWARD)
    steps = hypernetwork.visible_tiles(512, True)
    declared = hypernetwork.kernel_costs(knobs, True, (1, 8, 512, 64), 2, keep_z=True)
    recomputed = hypernetwork.kernel_costs(knobs, True, (1, 8, 512, 64), 2)
    for n in names:
      assert declared[n].bytes_accessed - recomputed[n].bytes_accessed == 10 * 128 * 128 * 64 * 2
    declared = {n: (declared[n].flops, declared[n].bytes_accessed) for n in names}
  else:
    assert schedule["impl"] == "splash"
    names = (softmax.SPLASH_FORWARD, softmax.SPLASH_BACKWARD)
    steps, declared = 8, dict.fromkeys(names, (0, 0))
  kernels = 0.0
  for kernel, name in zip(("forward", "backward"), names):
    k = schedule[kernel]
    assert k["kernel"] == name and k["visible_steps"] == steps and k["bundles_per_step"] > 1000
    assert (k["flops"], k["hbm_bytes"]) == declared[name]
    assert k["units"]["VALU"]["slots"] == 4 and 0 < k["units"]["VALU"]["used"] <= 4
    assert k["units"]["MXU"]["slots"] == 4 and k["units"]["MXU"]["used"] > 0
    if preset == "hyla":
      # The tiles below the causal diagonal and the packed diagonal ones are counted as separate
      # programs, each for its own steps (6 and 4 of a row's 10), and the packed rows take fewer bundles.
      below, diagonal = k["programs"]
      assert [(p["tiles"], p["steps"]) for p in k["programs"]] == [("below", 6), ("diagonal", 4)]
      assert diagonal["bundles_per_step"] < 0.95 * below["bundles_per_step"]
      assert k["cycles"] == sum(p["bundles_per_step"] * p["steps"] for p in k["programs"])
    kernels += max(k["cycles"] / 1.5e9, k["hbm_bytes"] / 819e9)
  if preset == "hyla":  # the products batched over queries are on the MXU, not reductions across lanes
    assert not any("xlane" in op for op in schedule["forward"]["operations"])
  for field in ("cycles", "flops", "hbm_bytes"):
    assert r[f"kernel_{field}"] == sum(schedule[k][field] for k in ("forward", "backward"))
  step = (max(r["compiler_flops"], r["model_flops"]) - r["kernel_flops"]) / 197e12
  assert r["roofline_step_seconds"] == pytest.approx(
      max(step, (r["compiler_bytes"] - r["kernel_hbm_bytes"]) / 819e9) + kernels)
  assert r["roofline_hours"] == pytest.approx(r["roofline_step_seconds"] * r["steps"] / 3600)
  assert r["tokens"] == r["steps"] * 16 * 512
  # One operation after another: XLA's by the compiler's estimate of each, which a parse that missed
  # them would leave near 0 (the projections and MLP alone are 34 GFLOP per chip: 0.17 ms at peak), the
  # attention's kernels as scheduled, and no Pallas kernel left without a time.
  assert r["xla_op_seconds"] > 0.17e-3 and r["unpriced_kernels"] == []
  assert r["estimated_step_seconds"] == pytest.approx(r["xla_op_seconds"] + r["kernel_seconds"] +
                                                      r["declared_kernel_seconds"])
  assert r["estimated_hours"] == pytest.approx(r["estimated_step_seconds"] * r["steps"] / 3600)

  text = compile_lib.format_report(r).splitlines()
  assert text[0].startswith(f"{preset} attention, {exp.num_params:,} parameters, 16 rows x 512 "
                            "tokens per step; v5e:4x4: 16 chips (TPU v5 lite) on 4 hosts")
  assert "of 16.00 GiB HBM: fits" in text[6]
  # The compiler's bytes count what lives in on-chip memory too; what goes through HBM is less.
  assert 0 < r["hbm_traffic_bytes"] < r["compiler_bytes"]
  assert text[11].startswith("  bytes through HBM") and f"{r['hbm_traffic_bytes']:.3e}" in text[11]
  assert text[13].startswith("estimates, not measurements")
  assert text[14].startswith(f"  step time   {r['estimated_step_seconds'] * 1e3:.1f} ms: the operations one")
  assert "the attention's Pallas kernels" in text[
      14] and "(each the longer of the compiler's schedule" in text[14]
  assert text[15].endswith("B tokens)") and f"{r['estimated_hours']:.1f} h" in text[15]
  assert text[16].startswith(
      f"  roofline    {r['roofline_step_seconds'] * 1e3:.1f} ms") and "; bound: " in text[16]
  # The compiler's own estimate only when it is one: it is negative when some operation is untimed.
  for seconds, shown in ((-17.004, "unusable (-17.004 s: negative when"), (0.0123, "12.3 ms")):
    assert shown in compile_lib.format_report({**r, "optimal_seconds": seconds}).splitlines()[12]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dumps unreadable", "flash attention"])
def test_kernels_the_compiler_cannot_schedule_leave_the_rest_of_the_report(case, monkeypatch):
  """When the attention's kernels cannot be timed (splash's, when the dump reader fails; flash
  attention's, which softmax runs with a position bias and which have no schedule reader), lm-compile
  still reports memory, FLOPs and the roofline, and says the kernels are missing from the step time.
  (Softmax in both, narrower than c4_50m with a small vocabulary: the report's path is the same, and
  the step compiles in a third of the time.)"""
  config = c4_50m.get_config()
  config.model.update(L=1, V=512, D=128, H=2, F=256, attention="softmax")
  # 2,048 tokens per chip: the cross-entropy's kernels run, and are timed whatever the attention's are.
  config.train.batch_size = 64
  reason = "no schedule for the pallas kernels"
  if case == "dumps unreadable":
    reason = "FileNotFoundError: libtpu wrote no dump"

    def fail(**_):
      raise RuntimeError(f"compiling the splash kernels for v5e:4x4 failed:\n{reason}")

    monkeypatch.setattr(compile_lib.kernel_schedule, "schedule", fail)
  else:
    config.model.update(positions="relative_bias")
  r = compile_lib.report(config, "v5e:4x4")
  assert r["fits"] and r["kernel_cycles"] == 0 and r["kernel_schedules"] == []
  assert r["kernels_untimed"] == reason
  assert r["bound"] == "HBM bandwidth (attention kernels untimed)"
  assert r["roofline_step_seconds"] == pytest.approx(r["compiler_bytes"] / 819e9)
  assert (f"  the attention's Pallas kernels are not in the step time: {reason}"
          in compile_lib.format_report(r).splitlines())
  ce = r["cross_entropy_schedule"]
  assert [ce[k]["kernel"] for k in ("forward", "backward")] == [cross_entropy.FORWARD, cross_entropy.BACKWARD]
  assert ce["kernels"] == "pallas_keep_logits"  # a chip's 2,048 x 512 float32 logits are kept
  assert r["cross_entropy_seconds"] == pytest.approx(
      compile_lib.kernel_seconds([ce], topology.CHIPS["TPU v5 lite"]))
  assert r["cross_entropy_seconds"] > 0 and r["cross_entropy_untimed"] == ""
  if case == "dumps unreadable":  # splash's kernels declare no cost either: the per-operation sum says so
    assert r["unpriced_kernels"] and all(n.startswith("splash_mha_") for n in r["unpriced_kernels"])
    assert f"no time for {r['unpriced_kernels'][0]}" in compile_lib.format_report(r)


def test_per_operation_time_reads_the_compiled_hlo():
  """XLA's operations at the compiler's estimated cycles; a scheduled kernel left to its schedule; another
  at the longer of its declared FLOPs at peak and bytes at bandwidth; a kernel declaring nothing listed."""
  hlo = "\n".join([
      '  %fusion.1 = bf16[8,128]{1,0} fusion(%p), kind=kOutput, backend_config={"estimated_cycles":"3000"}',
      '  %convert.2 = f32[8]{0} convert(%a), backend_config={"flag_configs":[],"estimated_cycles":"1500"}',
      '  %hypernetwork_fwd.6 = bf16[8] custom-call(%q), custom_call_target="tpu_custom_call", '
      'backend_config={"custom_call_config":{"cost_estimate":{"flops":"197000000000","bytes_accessed":"9"}}}',
      '  %cross_entropy_fwd.1 = f32[8] custom-call(%x), custom_call_target="tpu_custom_call", backend_config='
      '{"custom_call_config":{"cost_estimate":{"flops":"394000000","transcendentals":"7","bytes_accessed":'
      '"819000"}}}',
      '  %cross_entropy_bwd.1 = f32[8] custom-call(%x), custom_call_target="tpu_custom_call", backend_'
      'config={"custom_call_config":{"cost_estimate":{"flops":"197","transcendentals":"0","bytes_accessed":'
      '"8190000"}}}',
      '  %splash_mha_fwd.3 = f32[8] custom-call(%x), custom_call_target="tpu_custom_call", backend_config={}',
      '  %all-reduce.1 = f32[8]{0} all-reduce(%g), replica_groups={}',
  ])
  chip = topology.CHIPS["TPU v5 lite"]
  parts = compile_lib.per_operation(hlo, {"hypernetwork_fwd"}, 197e12, chip)
  # 4,500 cycles at 1.5 GHz; 2 us of FLOPs, then 10 us of bytes
  assert parts["xla_op_seconds"] == pytest.approx(3e-6)
  assert parts["declared_kernel_seconds"] == pytest.approx(2e-6 + 10e-6)
  assert parts["unpriced_kernels"] == ["splash_mha_fwd.3"]


@pytest.mark.slow
def test_text_report_and_does_not_fit():
  """32768 rows (2048 per chip) need ~28 GiB of temporaries: the compiler stops at once, exit 1."""
  result = lm_compile("--topology=v5e:4x4", "--config.model.L=1", "--config.train.batch_size=32768")
  assert result.returncode == 1, result.stderr[-3000:]
  out = result.stdout
  assert "32768 rows x 512 tokens per step; v5e:4x4: 16 chips (TPU v5 lite) on 4 hosts" in out
  assert "DOES NOT FIT in 16.00 GiB of HBM" in out
  assert "exceeds available HBM (15.75G)" in out  # the compiler's own numbers
  assert "To fit: lower train.batch_size, raise train.microbatches" in out
  assert "attention_impl" not in out
  # HYLA's kernels keep z at 512 tokens: the report names the implementation that does not.
  hyla = lm_compile("--topology=v5e:4x4", "--config.model.L=1", "--config.train.batch_size=32768",
                    "--config.model.attention=hyla", "--json")
  r = json.loads(hyla.stdout)
  assert hyla.returncode == 1 and not r["fits"] and r["attention_impls"] == ["pallas_hypernetwork_keep_z"]
  assert "recompute z instead of keeping it" in compile_lib.format_report(r).splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize("topology, message", [
    ("v5e:3x3", "libtpu rejects topology 'v5e:3x3' (INVALID_ARGUMENT: Topology layout"),
    ("tpu7", "unknown topology 'tpu7'"),
])
def test_unknown_topology(topology, message):
  result = lm_compile(f"--topology={topology}")
  assert result.returncode == 2
  assert message in result.stderr
  assert "choose one of: v5e:{2x2,2x4,4x4,4x8,8x8,8x16,16x16}; v5p:{2x2x1," in result.stderr


@pytest.mark.slow
def test_the_compiler_counts_what_the_kernels_declare(monkeypatch):
  """lm-compile takes the kernels' declared FLOPs and bytes out of the compiler's count before adding
  the kernels' own time: that count holds them exactly once (here declaring twice the bytes adds the
  declared bytes once more, and the FLOPs are the declared ones and little else)."""
  knobs = attention.Knobs(**attention.preset("hyla"))
  chip = jax.sharding.SingleDeviceSharding(compile_lib.topology_devices("v5e:2x2")[0])
  x = jax.ShapeDtypeStruct((1, 256, 2, 64), jax.numpy.bfloat16, sharding=chip)

  def cost():
    out = lambda q, k, v: hypernetwork.attend_pallas_hypernetwork(q, k, v, knobs=knobs)
    f = jax.grad(lambda q, k, v: jax.numpy.square(out(q, k, v).astype(np.float32)).sum(), argnums=(0, 1, 2))
    return jax.jit(f).lower(x, x, x).compile().cost_analysis()

  declared = hypernetwork.kernel_costs(knobs, True, (1, 2, 256, 64), 2).values()
  once = cost()
  # Beside the kernels, XLA's few element-wise operations (the loss).
  assert 0 <= once["flops"] - sum(c.flops for c in declared) < 1e-3 * once["flops"]
  kernel_costs = hypernetwork.kernel_costs
  monkeypatch.setattr(
      hypernetwork, "kernel_costs", lambda *a: {
          name:
              pl.CostEstimate(flops=c.flops, transcendentals=c.transcendentals, bytes_accessed=2 * c.
                              bytes_accessed) for name, c in kernel_costs(*a).items()
      })
  assert cost()["bytes accessed"] - once["bytes accessed"] == sum(c.bytes_accessed for c in declared)


def test_kernel_schedule_counts_a_loop_inside_a_grid_step_per_trip(tmp_path):
  """A loop inside a kernel's grid step (HYLA's backward kernel loops over heads) appears once in the
  compiler's listing, its bundles marked at loop depth 2; they count once per trip, and a kernel not
  said to loop that does is an error, not a short count."""
  (tmp_path / "1-k-71-schedule-analysis_final_bundles.txt"
  ).write_text("Schedule analysis:\n\ttotal scheduled bundles:    7\n")
  listing = [
      "  0x0   :  { %1 = vsyncpa }", "  0x1 LB: > { %2 = sst }", "  0x2 LB: >> { %3 = vmul.f32 }",
      "  0x3   : >> { %4 = vadd.f32 }", "  0x4   : >> { %5 = vst }", "  0x5 PF: > { %6 = sbr.rel }",
      "  0x6   :  { %7 = vsyncpa }"
  ]
  (tmp_path / "1-k-72-final_bundles.txt").write_text("\n".join(listing) + "\n")
  assert kernel_schedule.bundles(str(tmp_path), "k", loop_trips=4) == 7 + 3 * 3
  assert kernel_schedule.bundles(str(tmp_path), "k", loop_trips=1) == 7
  with pytest.raises(ValueError, match="k's grid step holds a loop .3 bundles at loop depth 2."):
    kernel_schedule.bundles(str(tmp_path), "k")


@pytest.mark.slow
def test_kernel_schedule_of_splash_kernels():
  """Softmax's splash kernels, timed the same way (here with packed documents' segment ids): at 1,024
  tokens in blocks of 512, each head and row computes 3 of the 4 block pairs causally (the fourth grid
  step skips its work)."""
  r = kernel_schedule.schedule(impl="splash", knobs=attention.preset("softmax"), rows=2, seq_len=1024,
                               heads=8, head_dim=64, dtype="bfloat16", causal=True, segments=True,
                               topology="v5e:2x2")
  assert softmax.splash_block(1024) == 512
  for kernel, name in (("forward", softmax.SPLASH_FORWARD), ("backward", softmax.SPLASH_BACKWARD)):
    k = r[kernel]
    assert k["kernel"] == name and k["visible_steps"] == 2 * 8 * 3
    assert k["bundles_per_step"] > 500 and k["cycles"] == k["bundles_per_step"] * k["visible_steps"]
    assert k["units"]["MXU"]["used"] > 0 and (k["flops"], k["hbm_bytes"]) == (0, 0)
  with pytest.raises(ValueError, match="no schedule for attention implementation 'pallas'"):
    kernel_schedule.schedule(impl="pallas", knobs=attention.preset("softmax"), rows=1, seq_len=512, heads=8,
                             head_dim=64, dtype="bfloat16", causal=True, segments=True, topology="v5e:2x2")


@pytest.mark.slow
def test_kernel_schedule_of_cross_entropy_kernels():
  """The readout cross-entropy's kernels, timed the same way: 4,096 tokens of a [128, 5,120] readout in
  vocabulary blocks of 2,560 words, the forward kernel in blocks of 1,024 tokens as it writes the logits
  (2,048 when they are recomputed), the backward in 8 x 2 (512 tokens); each the bundles of its program
  times its grid steps, and the traffic it declares: with the logits kept, their float32 bytes once
  more in each kernel (and the forward reads w once per block of 1,024) and two products backward
  instead of three. (The kernels that recompute the logits are read the same way: compiled for TPU in
  tests/test_cross_entropy.py.)"""
  r = kernel_schedule.cross_entropy_schedule(tokens=4096, width=128, vocab=5120, dtype="bfloat16",
                                             topology="v5e:2x2", kernels="pallas_keep_logits")
  declared = cross_entropy.kernel_costs(4096, 128, 5120, 2, True)
  recomputed = cross_entropy.kernel_costs(4096, 128, 5120, 2, False)
  assert declared[cross_entropy.BACKWARD].flops == 4 * 4096 * 128 * 5120
  assert recomputed[cross_entropy.BACKWARD].flops == 6 * 4096 * 128 * 5120
  for name, w_reads in ((cross_entropy.FORWARD, 2), (cross_entropy.BACKWARD, 0)):
    assert declared[name].bytes_accessed - recomputed[
        name].bytes_accessed == 4 * 4096 * 5120 + w_reads * 128 * 5120 * 2
  assert cross_entropy.grid_steps(4096, 128, 5120, 2, False) == {
      cross_entropy.FORWARD: 4,
      cross_entropy.BACKWARD: 16
  }
  assert cross_entropy.grid_steps(4096, 128, 5120, 2, True) == {
      cross_entropy.FORWARD: 8,
      cross_entropy.BACKWARD: 16
  }
  for kernel, name, steps in (("forward", cross_entropy.FORWARD, 8), ("backward", cross_entropy.BACKWARD,
                                                                      16)):
    k = r[kernel]
    assert (k["kernel"], k["visible_steps"], k["hbm_bytes"]) == (name, steps, declared[name].bytes_accessed)
    assert k["bundles_per_step"] > 500 and k["cycles"] == k["bundles_per_step"] * steps
    assert k["units"]["MXU"]["used"] > 0


@pytest.mark.slow
def test_kernel_schedules_take_each_chips_share_of_rows_and_heads(monkeypatch):
  """lm-compile times the kernels on one chip's share: rows split over the batch axes, and heads over
  the tensor axis for the kernels that split them (splash's, linear attention's), not for HYLA's,
  which take every head on every chip. (No compile: the schedule's arguments are what is checked.)"""
  config = c4_50m.get_config()
  config.model.update(L=3, attention="softmax,linear,hyla")
  config.train.batch_size = 16
  config.mesh.update(data=4, fsdp=1, tensor=4, shard_state_over_data=False)
  exp = Experiment(config, devices=compile_lib.topology_devices("v5e:4x4"))
  calls = {}
  monkeypatch.setattr(compile_lib.kernel_schedule, "schedule",
                      lambda **kw: calls.setdefault(kw["impl"], kw) and {})
  compile_lib.kernel_schedules(exp, ["splash", "pallas_linear", "pallas_hypernetwork_keep_z"], "v5e:4x4")
  assert {
      impl: (kw["rows"], kw["heads"]) for impl, kw in calls.items()
  } == {
      "splash": (4, 2),
      "pallas_linear": (4, 2),
      "pallas_hypernetwork_keep_z": (4, 8)
  }


@pytest.mark.slow
def test_kernel_schedule_of_linear_kernels():
  """Linear attention's kernels, timed the same way: at 1,024 tokens in blocks of 512, each head and row
  computes 3 of the 4 tiles causally; each kernel declares the FLOPs and bytes of kernel_costs, and its
  products are on the MXU."""
  r = kernel_schedule.schedule(impl="pallas_linear", knobs=attention.preset("linear"), rows=2, seq_len=1024,
                               heads=2, head_dim=64, dtype="bfloat16", causal=True, segments=True,
                               topology="v5e:2x2")
  declared = linear.kernel_costs(True, (2, 2, 1024, 64), 2)
  for kernel, name in (("forward", linear.FORWARD), ("backward", linear.BACKWARD)):
    k = r[kernel]
    assert k["kernel"] == name and k["visible_steps"] == 2 * 2 * 3
    assert k["bundles_per_step"] > 500 and k["cycles"] == k["bundles_per_step"] * k["visible_steps"]
    assert (k["flops"], k["hbm_bytes"]) == (declared[name].flops, declared[name].bytes_accessed)
    assert k["units"]["MXU"]["used"] > 1


def test_every_listed_topology_exists():
  for chip, shapes in topology.EXAMPLES.items():
    for shape in shapes:
      devices = compile_lib.topology_devices(f"{chip}:{shape}")
      assert len(devices) == math.prod(int(n) for n in shape.split("x"))
      assert devices[0].device_kind in compile_lib.CHIPS


def _spec(batch):
  return {k: (v.shape[1:], v.dtype) for k, v in batch.items()}


def test_batch_spec_is_a_real_batch(small_corpus):
  """What lm-compile compiles for is what the pipelines feed: fields, row shapes, dtypes."""
  for config in (small_config(small_corpus), sraven.get_config()):
    exp = Experiment(config, devices=jax.devices()[:1])
    spec = exp.batch_spec()
    real = next(exp.task.train_iterator(pipeline.Shard(), 2))
    assert {k: (v.shape[1:], np.dtype(v.dtype)) for k, v in spec.items()} == _spec(real)
    assert {v.shape[0] for v in spec.values()} == {config.train.batch_size}


def _loop_carry_scatters(hlo: str) -> list[set[str]]:
  """In a compiled program's text: every scatter inside a loop whose base is one of the loop's carried
  values zeroed on some devices (a select on partition-id, SPMD's form of the embedding gather's
  gradient summed over data shards), with the operations that use the scatter's result."""
  comps, name = {}, None
  for line in hlo.splitlines():
    if m := re.match(r"(?:ENTRY )?%([\w.\-]+) ", line):
      name, comps[m.group(1)] = m.group(1), {}
    elif name and (d := re.match(r"\s+(?:ROOT )?%([\w.\-]+) = (.*)", line)):
      comps[name][d.group(1)] = d.group(2)
  args = lambda rhs: re.findall(r"%([\w.\-]+)", rhs.split("), ")[0])
  opcode = lambda rhs: re.search(r"(?<![\w\-])([a-z][a-z\-]*)\(", rhs).group(1)
  found = []
  for body in set(re.findall(r"body=%([\w.\-]+)", hlo)):
    ops = comps[body]

    def does(n, what):  # n is `what`, or a fusion whose computation holds one
      called = re.search(r"calls=%([\w.\-]+)", ops[n])
      return opcode(ops[n]) == what or bool(called) and any(
          opcode(r) == what for r in comps.get(called.group(1), {}).values())

    def on_partition(n, seen):
      if n in seen or n not in ops:
        return False
      seen.add(n)
      return opcode(ops[n]) == "partition-id" or any(on_partition(a, seen) for a in args(ops[n]))

    carried = {
        n for n, rhs in ops.items()
        if opcode(rhs) == "get-tuple-element" and opcode(ops.get(args(rhs)[0], "x(")) == "parameter"
    }
    for n, rhs in ops.items():
      if does(n, "select") and carried & set(args(rhs)) and any(
          on_partition(a, set()) for a in args(rhs) if a not in carried):
        for s, srhs in ops.items():
          if n in args(srhs) and does(s, "scatter"):
            found.append({opcode(urhs) for u, urhs in ops.items() if s in args(urhs)})
  return found


@pytest.mark.slow
def test_microbatch_loop_sums_the_embedding_gradient_on_every_device(v5e_2x2):
  """With microbatches, the embedding's gradient (a scatter) is accumulated in the loop; on a
  multi-chip mesh SPMD zeroes the accumulated value on all but one device of the data group before
  each scatter and relies on the all-reduce after it. libtpu before 0.0.50 moved that all-reduce out
  of the loop (openxla/xla#49143), dropping every other device's earlier microbatches; the train step
  must keep it inside the loop."""
  c = tiny.get_config()
  c.model.update(D=64, H=4, L=1, F=128)
  c.train.update(batch_size=8, microbatches=2)
  c.mesh.update(data=4, fsdp=1, tensor=1)
  exp = Experiment(c, devices=v5e_2x2.devices)
  scatters = _loop_carry_scatters(exp.lower_train_step().compile().as_text())
  assert scatters and all("all-reduce" in users for users in scatters), scatters
  # lm-compile says when it compiles without the pass.
  text = compile_lib.format_report(compile_lib.report(c, "v5e:2x2"))
  assert ("compiled without while-loop-all-reduce-code-motion" in text) == bool(exp.train_compiler_options)
  # The check above sees the fault: without the option, the affected libtpu leaves the loop with the
  # zeroed sums (their only user is the loop's result).
  if exp.train_compiler_options:
    exp = Experiment(c, devices=v5e_2x2.devices)
    exp.train_compiler_options = None
    scatters = _loop_carry_scatters(exp.lower_train_step().compile().as_text())
    assert scatters == [{"tuple"}], scatters


def test_microbatch_compiler_options():
  off = {"xla_disable_hlo_passes": "while-loop-all-reduce-code-motion"}
  assert microbatch_compiler_options(2, "tpu", "0.0.42.1") == off
  assert microbatch_compiler_options(2, "tpu", None) == off
  assert microbatch_compiler_options(2, "tpu", "0.0.50.1") == {}
  assert microbatch_compiler_options(1, "tpu", "0.0.42.1") == {}
  assert microbatch_compiler_options(4, "cpu", "0.0.42.1") == {}
  assert microbatch_compiler_options(2, "gpu", None) == off
