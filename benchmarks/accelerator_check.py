"""One command that checks this repository on an accelerator and measures it, in a few minutes.

  python benchmarks/accelerator_check.py --out=DIR            # on a GPU machine, from the repository root
  python benchmarks/accelerator_check.py --out=DIR --smoke    # every part at tiny sizes (CPU: seconds)

In order: the platform and versions; the tests marked `accelerator` (tests/test_accelerator.py,
skipped without a GPU); a few steps of configs/tiny.py on the embedded corpus, whose losses must match
the CPU's (benchmarks/accelerator_check_cpu.json, written on a CPU with --write_cpu_reference);
configs/c4_50m.py's training step on synthetic packed batches for each --variants (one device: the
global batch in the fewest microbatches that fit): tokens/s, MFU, peak device memory and the attention
kernel each layer runs; and lm-sample's decoding step (benchmarks/decode.py's measure) per variant at
--decode_context. Writes DIR/accelerator_check.json and DIR/accelerator_check.md; the exit status is 1
when a test failed, the tiny losses differ or a variant failed to run.

Wheels to carry beyond jax (with its CUDA plugin), flax and optax, for Python 3.12 (`pip download
--no-deps --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 -d wheels ...`,
then there `pip install --no-deps wheels/*.whl`): grain==0.2.18, array-record==0.8.6,
portpicker==1.6.0, ml-collections==1.1.0, tensorboardX==2.6.5. It also imports orbax-checkpoint,
sentencepiece, etils, absl-py, numpy, pyyaml and pytest, which the GPU image of docs/guides/gpu.md holds.
"""

import argparse
import dataclasses
import importlib.metadata
import json
import pathlib
import platform as python_platform
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from configs import c4_50m, tiny  # noqa: E402
from data_pipelines import pipeline  # noqa: E402
from lm import decode, flops, model as model_lib  # noqa: E402
from lm.experiment import Experiment  # noqa: E402

CPU_REFERENCE = pathlib.Path(__file__).with_name("accelerator_check_cpu.json")
VARIANTS = ("softmax", "softmax_unpacked", "linear", "hyla", "hyla,softmax")
TINY_STEPS = 5
# The GPU's float32 products (TF32 by default) and other reduction orders move a loss this much.
TINY_RTOL = 2e-2


def versions() -> dict:
  packages = {}
  for d in importlib.metadata.distributions():
    name = (d.metadata["Name"] or "").lower()
    if name.startswith(("jax", "flax", "optax", "orbax", "nvidia-cudnn", "grain")):
      packages[name] = d.version
  devices = jax.devices()
  return dict(python=python_platform.python_version(), backend=jax.default_backend(), devices=len(devices),
              device_kind=devices[0].device_kind, processes=jax.process_count(),
              packages=dict(sorted(packages.items())))


def run_tests() -> dict:
  """The accelerator tests in a fresh process (tests/conftest.py needs test-only packages: skipped)."""
  start = time.perf_counter()
  result = subprocess.run([
      sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider", "-m", "accelerator",
      "tests/test_accelerator.py"
  ], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  lines = result.stdout.strip().splitlines()
  return dict(ok=result.returncode in (0, 5), summary=lines[-1] if lines else result.stderr[-500:],
              failures=[l for l in lines if l.startswith(("FAILED", "ERROR"))],
              seconds=round(time.perf_counter() - start, 1))


def tiny_losses(data_dir: str, steps: int) -> list[float]:
  """configs/tiny.py's first `steps` training losses on the embedded corpus (float32)."""
  c = tiny.get_config()
  c.data.dir = data_dir
  c.mesh.update(data=1)
  exp = Experiment(c, devices=jax.devices()[:1])
  batches = exp.task.train_iterator(pipeline.Shard(0, 1), c.train.batch_size)
  state, losses = exp.init_state(), []
  for _ in range(steps):
    state, stats = exp.train_step(state, exp.global_batch(next(batches)))
    losses.append(float(stats["loss"]))
  return losses


def packed_batch(rows: int, seq_len: int, V: int, seed: int, segments: bool) -> dict[str, np.ndarray]:
  """Random tokens packed as the pipeline packs documents (segments of 64 to seq_len tokens)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, V, (rows, seq_len + 1)).astype(np.int32)
  seg, pos = np.ones_like(tokens), np.tile(np.arange(seq_len + 1, dtype=np.int32), (rows, 1))
  if segments:
    for r in range(rows):
      start, s = 0, 1
      while start < seq_len + 1:
        end = min(seq_len + 1, start + int(rng.integers(64, seq_len + 1)))
        seg[r, start:end], pos[r, start:end] = s, np.arange(end - start)
        start, s = end, s + 1
  batch = pipeline.to_model_batch({"inputs": tokens, "inputs_segment_ids": seg, "inputs_positions": pos})
  if not segments:
    del batch["segment_ids"]
  return batch


def c4_config(variant: str, smoke: bool, batch_size: int, microbatches: int):
  c = c4_50m.get_config()
  c.model.attention = variant.removesuffix("_unpacked")
  c.mesh.update(data=-1, shard_state_over_data=False)
  c.train.update(batch_size=batch_size, microbatches=microbatches, warmup_steps=2)
  if smoke:
    c.model.update(V=512, D=64, H=2, L=2, F=128)
    c.data.seq_len = 128
  return c


def _is_oom(e: Exception) -> bool:
  return "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


def train_step(variant: str, smoke: bool, batch_size: int, steps: int) -> dict:
  """c4_50m's step for one variant: the fewest microbatches (1, 2, 4, ...) whose step fits."""
  segments = not variant.endswith("_unpacked")
  for microbatches in (1, 2, 4, 8, 16):
    c = c4_config(variant, smoke, batch_size, microbatches)
    try:
      exp = Experiment(c)
      T = c.data.seq_len
      batch = exp.global_batch(packed_batch(batch_size, T, exp.model_cfg.V, 0, segments))
      lowered = exp.lower_train_step().as_text()
      state = exp.init_state()
      start = time.perf_counter()
      state, stats = exp.train_step(state, batch)
      float(stats["loss"])
      compile_s = time.perf_counter() - start
      start = time.perf_counter()
      for _ in range(steps):
        state, stats = exp.train_step(state, batch)
      loss = float(stats["loss"])
      seconds = (time.perf_counter() - start) / steps
    except Exception as e:  # pylint: disable=broad-except
      if _is_oom(e) and microbatches < 16:
        continue
      return dict(variant=variant, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    cfg, devices = exp.model_cfg, jax.devices()
    tokens_per_s = batch_size * T / seconds
    per_token = flops.flops_per_token(cfg, exp.num_params, T)
    peak = flops.peak_flops(devices)
    memory = devices[0].memory_stats() or {}
    platform = devices[0].platform
    return dict(variant=variant, segments=segments, batch_size=batch_size, microbatches=microbatches,
                seq_len=T, params=exp.num_params, step_ms=round(seconds * 1e3, 2),
                compile_s=round(compile_s, 1), tokens_per_s=round(tokens_per_s), loss=loss,
                mfu=None if peak is None else round(tokens_per_s * per_token / peak, 4),
                peak_memory_gib=round(memory["peak_bytes_in_use"] / 2**30, 2) if memory else None,
                attention=[cfg.layer_impl(l, T, platform, segments) for l in range(cfg.L)],
                cudnn_in_program="cudnn" in lowered.lower(), triton_in_program="triton" in lowered.lower())
  raise AssertionError("unreachable")


def decode_time(variant: str, smoke: bool, context: int, tokens: int) -> dict:
  """Seconds per token of lm-sample's decoding step at the end of a `context`-token state (one row)."""
  c = c4_config(variant, smoke, 1, 1)
  cfg = dataclasses.replace(model_lib.ModelConfig.from_dict(c.model.to_dict()), dtype="float32")
  decoder = decode.Decoder(cfg, context)
  params = model_lib.Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
  cache = decoder.init_cache(params, 1)
  cache["index"] = jnp.asarray(context - tokens - 1, jnp.int32)
  greedy, key, token_b = decode.Sampling(temperature=0), jax.random.key(0), jnp.zeros((1,), jnp.int32)
  token_b, cache = decoder.step(params, cache, token_b[:, None], greedy, key)  # compiles
  token_b.block_until_ready()
  start = time.perf_counter()
  for _ in range(tokens):
    token_b, cache = decoder.step(params, cache, token_b[:, None], greedy, key)
  token_b.block_until_ready()
  return dict(variant=variant, context=context, ms_per_token=round(
      (time.perf_counter() - start) / tokens * 1e3, 3))


def markdown(r: dict) -> str:
  v = r["platform"]
  lines = [
      f"# Accelerator check: {v['device_kind']} x {v['devices']} ({v['backend']})", "",
      f"Python {v['python']}; " + ", ".join(f"{k} {x}" for k, x in v["packages"].items()), "",
      f"Tests marked accelerator: {r['tests']['summary']}", "",
      f"configs/tiny.py, {len(r['tiny']['losses'])} steps: losses {r['tiny']['losses']} against the CPU's "
      f"{r['tiny']['cpu_losses']}: {'match' if r['tiny']['match'] else 'DIFFER'} (rtol {TINY_RTOL})", "",
      "| variant | packed | batch x microbatches | step ms | tokens/s | MFU | peak GiB | attention per layer |",
      "|---|---|---|---|---|---|---|---|"
  ]
  for s in r["train"]:
    if "error" in s:
      lines.append(f"| {s['variant']} | | | failed: {s['error']} | | | | |")
      continue
    mfu = "" if s["mfu"] is None else f"{s['mfu']:.1%}"
    lines.append(f"| {s['variant']} | {s['segments']} | {s['batch_size']} x {s['microbatches']} | "
                 f"{s['step_ms']} | {s['tokens_per_s']:,} | {mfu} | {s['peak_memory_gib']} | "
                 f"{', '.join(s['attention'])} |")
  lines += [
      "", f"lm-sample's decoding step at context {r['decode'][0]['context'] if r['decode'] else '-'}:", "",
      "| variant | ms/token |", "|---|---|"
  ]
  lines += [f"| {d['variant']} | {d.get('ms_per_token', d.get('error'))} |" for d in r["decode"]]
  lines += ["", f"Command: `python benchmarks/accelerator_check.py {' '.join(sys.argv[1:])}`", ""]
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="Directory for accelerator_check.json and .md.")
  parser.add_argument("--smoke", action="store_true", help="Tiny sizes: every part in seconds (CPU).")
  parser.add_argument("--variants", default=",".join(VARIANTS).replace("hyla,softmax", "hyla+softmax"),
                      help="model.attention per variant, comma-separated; + joins a hybrid's layers.")
  parser.add_argument("--batch_size", type=int, default=256, help="c4_50m's global batch (rows of 512).")
  parser.add_argument("--steps", type=int, default=5, help="Timed steps per variant.")
  parser.add_argument("--decode_context", type=int, default=8192)
  parser.add_argument("--write_cpu_reference", action="store_true",
                      help=f"On a CPU: store the tiny losses in {CPU_REFERENCE.name} and stop.")
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  data_dir = str(out / "data")
  if args.write_cpu_reference:
    assert jax.default_backend() == "cpu", "the reference losses are the CPU's"
    CPU_REFERENCE.write_text(
        json.dumps(dict(steps=TINY_STEPS, losses=tiny_losses(data_dir, TINY_STEPS))) + "\n")
    return 0
  variants = [v.replace("+", ",") for v in args.variants.split(",") if v]
  batch_size, steps = (4, 1) if args.smoke else (args.batch_size, args.steps)
  context, tokens = (64, 2) if args.smoke else (args.decode_context, 16)
  r = dict(platform=versions(), smoke=args.smoke)
  print(json.dumps(r["platform"]), flush=True)
  r["tests"] = run_tests()
  print("tests:", r["tests"]["summary"], flush=True)
  cpu = json.loads(CPU_REFERENCE.read_text())
  losses = tiny_losses(data_dir, 2 if args.smoke else cpu["steps"])
  r["tiny"] = dict(losses=losses, cpu_losses=cpu["losses"][:len(losses)],
                   match=bool(np.allclose(losses, cpu["losses"][:len(losses)], rtol=TINY_RTOL)))
  print("tiny:", r["tiny"], flush=True)
  r["train"] = []
  for v in variants:
    r["train"].append(train_step(v, args.smoke, batch_size, steps))
    print("train:", json.dumps(r["train"][-1]), flush=True)
  r["decode"] = []
  for v in dict.fromkeys(v.removesuffix("_unpacked") for v in variants):
    try:
      r["decode"].append(decode_time(v, args.smoke, context, tokens))
    except Exception as e:  # pylint: disable=broad-except
      r["decode"].append(dict(variant=v, context=context, error=f"{type(e).__name__}: {str(e)[:300]}"))
    print("decode:", json.dumps(r["decode"][-1]), flush=True)
  (out / "accelerator_check.json").write_text(json.dumps(r, indent=1) + "\n")
  (out / "accelerator_check.md").write_text(markdown(r))
  failed = (not r["tests"]["ok"] or not r["tiny"]["match"] or any("error" in s for s in r["train"]) or
            any("error" in d for d in r["decode"]))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
