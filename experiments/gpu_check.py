"""The accelerator check: link bandwidth by source kind and d2h path, the cuDNN attention
kernel against the blockwise one, streaming vs resident, the largest model host RAM
holds, generation resident vs streamed, the disk tier's copies on disk against kept,
and the cost of making the streaming copy at each fetch.

  bash experiments/gpu_check.sh            # on the GPU machine; writes $OUT/gpu_check.json
  python experiments/gpu_check.py --quick --out=/tmp/g.json   # tiny sizes, any machine

MFU is against the peak stated in --peak_tflops (H200 SXM dense bf16: 989 TFLOPS,
NVIDIA H200 datasheet).
"""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from megatrain_jax import bench, metrics
from megatrain_jax.bench import steps
from megatrain_jax.engine import EngineConfig, StreamingTrainer
from megatrain_jax.models.config import LlamaConfig
from megatrain_jax.optim import adamw

flags.DEFINE_string("out", "gpu_check.json", "Output JSON.")
flags.DEFINE_bool("quick", False, "Tiny sizes (for testing the script itself).")
flags.DEFINE_float("peak_tflops", 989.0, "Peak dense bf16 TFLOPS of the device, for MFU.")
FLAGS = flags.FLAGS

# ~2.8B parameters: fp32 masters + Adam moments + bf16 copy = 14 B/param = ~40 GB of host RAM.
BIG = LlamaConfig(vocab_size=32000, d_model=3072, n_layers=26, n_heads=24, n_kv_heads=8,
                  d_ff=8192, max_seq_len=4096)
# ~0.9B parameters: fits on the device for the resident comparison.
FITS = LlamaConfig(vocab_size=32000, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=8,
                   d_ff=5632, max_seq_len=4096)
TINY = LlamaConfig(vocab_size=260, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128,
                   max_seq_len=128)


def link_bandwidth(nbytes: int, reps: int) -> dict:
  """h2d GB/s of jax.device_put from each source kind into device memory."""
  dev = jax.devices()[0]
  S = jax.sharding.SingleDeviceSharding
  to_dev = S(dev, memory_kind="device")
  n = nbytes // 4
  src = np.ones(n, np.float32)
  sources = {"numpy_pageable": lambda: src,
             "cpu_backend_array": lambda: jax.device_put(src, jax.devices("cpu")[0])}
  try:
    pinned = jax.device_put(src, S(dev, memory_kind="pinned_host"))
    sources["pinned_host"] = lambda: pinned
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("no pinned_host memory: %s", e)
  out = {}
  for name, make in sources.items():
    arr = make()
    jax.block_until_ready(arr)
    t = bench.median_times({"x": lambda: jax.device_put(arr, to_dev)}, 1, reps)["x"]
    out[f"h2d_gb_per_s_{name}"] = nbytes / t / 1e9
  if "h2d_gb_per_s_pinned_host" in out:
    for name in sources:
      out[f"h2d_over_pinned_{name}"] = (out[f"h2d_gb_per_s_{name}"]
                                        / out["h2d_gb_per_s_pinned_host"])
  return out


def d2h_paths(nbytes: int, reps: int) -> dict:
  """d2h GB/s of each way a device array can reach the host optimizer
  (`engine.transport.D2H_PATHS`), and of a template writing its output to pinned host
  memory directly."""
  dev = jax.devices()[0]
  S = jax.sharding.SingleDeviceSharding
  x = jax.device_put(np.ones(nbytes // 4, np.float32), S(dev, memory_kind="device"))
  cpu = S(jax.devices("cpu")[0])
  paths = {"cpu_backend": lambda: jax.device_put(x, cpu)}
  try:
    pinned = S(dev, memory_kind="pinned_host")
    jax.block_until_ready(jax.device_put(x, pinned))
    paths["pinned_host"] = lambda: jax.device_put(x, pinned)
    paths["pinned_host_then_cpu"] = lambda: jax.device_put(
        np.asarray(jax.device_put(x, pinned)), cpu)
    out_pinned = jax.jit(lambda a: a + 0, out_shardings=pinned)
    paths["template_output_pinned"] = lambda: out_pinned(x)
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("no pinned_host d2h: %s", e)
  t = bench.median_times({k: (lambda f=f: jax.block_until_ready(f())) for k, f in paths.items()},
                         1, reps)
  return {f"d2h_gb_per_s_{k}": nbytes / v / 1e9 for k, v in t.items()}


def attention_kernels(quick: bool) -> dict:
  """cuDNN's fused attention against the blockwise kernel, bf16, values and gradients
  (max difference over max value), with and without a sliding window."""
  from megatrain_jax.models import blockwise  # pylint: disable=import-outside-toplevel
  b, t, h, g, d = (1, 256, 4, 2, 64) if quick else (2, 4096, 32, 8, 128)
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(kk, (b, t, n, d), jnp.bfloat16)
                 for kk, n in zip(ks, (h, g, g, h)))
  out = {}
  for window in (None, 512):
    def run(impl):
      def f(q, k, v):
        if impl == "blockwise":
          return blockwise.blockwise_attention(q, k, v, window=window, block_q=512,
                                               block_k=512)
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn",
            local_window_size=None if window is None else (window - 1, 0))
      o, vjp = jax.vjp(f, q, k, v)
      return (o, *vjp(do))
    name = f"cudnn_vs_blockwise_{'window' if window else 'causal'}"
    try:
      got = run("cudnn")
    except Exception as e:  # pylint: disable=broad-except
      out[name] = f"unavailable: {type(e).__name__}: {str(e)[:200]}"
      continue
    want = run("blockwise")
    out[name] = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - w.astype(jnp.float32)))
                        / jnp.max(jnp.abs(w.astype(jnp.float32)))) for a, w in zip(got, want))
  return out


def stream_copy_cost(cfg: LlamaConfig, batch_size: int, seq_len: int, reps: int) -> dict:
  """Streaming step time with each fetch casting the fp32 master (stream_copy="on_fetch",
  2 B/param less host memory in bf16) over keeping the pinned copies (the accelerator
  default), bf16 compute, timed side by side with the last updates waited for."""
  batch = bench.synthetic_batch(cfg, batch_size, seq_len)
  make = lambda mode: StreamingTrainer.from_config(
      cfg, adamw(1e-5), EngineConfig(compute_dtype=jnp.bfloat16, stream_copy=mode),
      jax.random.key(0))
  with make("keep") as keep, make("on_fetch") as fetch:
    t = bench.median_times({"keep": lambda: (keep.step(batch), keep.wait()),
                                "on_fetch": lambda: (fetch.step(batch), fetch.wait())},
                               1, reps)
  return {"on_fetch_over_keep": t["on_fetch"] / t["keep"],
          "keep_step_time_s": t["keep"], "on_fetch_step_time_s": t["on_fetch"]}


def largest_model(cfg: LlamaConfig, batch_size: int, seq_len: int, steps: int,
                  peak_tflops: float) -> dict:
  batch = bench.synthetic_batch(cfg, batch_size, seq_len)
  ec = EngineConfig(compute_dtype=jnp.bfloat16, prefetch_depth=2)
  t0 = time.perf_counter()
  with StreamingTrainer.from_config(cfg, adamw(1e-5), ec, jax.random.key(0)) as eng:
    build_s = time.perf_counter() - t0
    t = bench.median_times({"s": lambda: eng.step(batch)}, 1, steps)["s"]
    st = eng.stats()
  tokens = batch_size * seq_len
  tflops = metrics.model_flops_per_token(cfg, seq_len) * tokens / t / 1e12
  return {"big_params": st["param_count"], "big_tokens_per_step": tokens,
          "big_step_time_s": t, "big_tokens_per_s": tokens / t, "big_model_tflops": tflops,
          "big_mfu": tflops / peak_tflops, "big_build_s": build_s,
          "big_device_peak_bytes": st["device_peak_bytes"], "big_last_step": st["last_step"]}


def generation(cfg: LlamaConfig, rows: int, prompt_len: int, new_tokens: int) -> dict:
  """`mt.generate` greedy, the weights resident against streamed from a
  StreamingTrainer (fp32, so the tokens must agree): tokens/s of each, second calls
  (compiled)."""
  from megatrain_jax.generation import generate  # pylint: disable=import-outside-toplevel
  prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (rows, prompt_len)).tolist()
  with StreamingTrainer.from_config(cfg, adamw(1e-5), EngineConfig(),
                                    jax.random.key(0)) as eng:
    out = {}
    for mode in ("resident", "streamed"):
      run = lambda: generate(eng, prompts, new_tokens, temperature=0.0,
                             streamed=mode == "streamed")
      run()
      g = run()
      out[mode] = g
  return {"gen_rows": rows, "gen_new_tokens": new_tokens,
          "gen_resident_tokens_per_s": out["resident"].stats["tokens_per_s"],
          "gen_streamed_tokens_per_s": out["streamed"].stats["tokens_per_s"],
          "gen_streamed_equals_resident": out["resident"].tokens == out["streamed"].tokens}


def disk_copies(cfg: LlamaConfig, steps: int = 3) -> dict:
  """The disk tier with the streaming copies in files (read at each fetch, staged into
  pinned memory and sent) against them kept in pinned memory: the same losses, bf16
  compute, on this machine's accelerator."""
  import tempfile  # pylint: disable=import-outside-toplevel
  batch = bench.synthetic_batch(cfg, 2, 64)
  losses = {}
  for mode in ("keep", "disk"):
    with tempfile.TemporaryDirectory() as d, StreamingTrainer.from_config(
        cfg, adamw(1e-4), EngineConfig(compute_dtype=jnp.bfloat16, state_tier="disk",
                                       state_dir=d, stream_copy=mode),
        jax.random.key(0)) as eng:
      losses[mode] = [float(eng.step(batch)["loss"]) for _ in range(steps)]
  return {"disk_copies_losses": losses["disk"],
          "disk_copies_equal_kept": losses["disk"] == losses["keep"]}


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  quick = FLAGS.quick
  out = {"machine": bench.machine(), "peak_tflops": FLAGS.peak_tflops}
  out.update(link_bandwidth(2**20 if quick else 2**30, 3 if quick else 5))
  out.update(d2h_paths(2**20 if quick else 2**30, 3 if quick else 5))
  logging.info("link: %s", out)
  save(out)
  out.update(attention_kernels(quick))
  logging.info("attention kernels: %s", {k: v for k, v in out.items() if "cudnn" in k})
  save(out)
  fits = TINY if quick else FITS
  suite = bench.Suite(model=fits, batch_size=2 if quick else 4,
                          seq_len=64 if quick else 4096, warmup=1, reps=1 if quick else 3)
  # recompute="none" would keep every layer's [T, T] probabilities (hundreds of GB at
  # 4 x 4096 tokens): only the policy between is timed here.
  ratios = steps.step_ratios(suite, kept=("dots",))
  out.update({f"fits_{k}": v for k, v in ratios.items()})
  logging.info("streaming / resident: %.3f", ratios["stream_over_resident_remat"])
  save(out)
  big = TINY if quick else BIG
  out.update(largest_model(big, 2 if quick else 4, 64 if quick else 4096,
                           1 if quick else 3, FLAGS.peak_tflops))
  save(out)
  out.update(generation(fits, 4 if quick else 32, 8 if quick else 128,
                        4 if quick else 64))
  logging.info("generation: %s", {k: v for k, v in out.items() if k.startswith("gen_")})
  save(out)
  out.update(disk_copies(TINY))
  logging.info("copies on disk: %s", {k: v for k, v in out.items() if "disk_copies" in k})
  save(out)
  # Last, so that a run cut short by the time limit still has the figures above.
  copies = stream_copy_cost(fits, suite.batch_size, suite.seq_len, suite.reps)
  out.update({f"fits_{k}": v for k, v in copies.items()})
  logging.info("streaming copy made at fetch / kept: %.3f", copies["on_fetch_over_keep"])
  save(out)


def save(out: dict) -> None:
  """Writes what has been measured so far (each part adds to it)."""
  with open(FLAGS.out, "w", encoding="utf-8") as f:
    json.dump(out, f, indent=2, sort_keys=True, default=str)
  logging.info("Wrote %s", FLAGS.out)


if __name__ == "__main__":
  app.run(main)
