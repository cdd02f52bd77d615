"""Benchmarks: every figure a side-by-side ratio, medians after warm-up.

  python experiments/bench.py --suite=cpu --out=bench.json      # ~25 min on 2 CPU cores

Writes one JSON object with stream_over_resident_remat, stream_over_resident,
overlap_efficiency, no_prefetch_over_prefetch, host_opt_bw_ratio,
host_bytes_per_param, lora_over_full_step, host_bytes_per_base_param_lora, and the
sizes, times and machine behind them.
`--suite=smoke` runs the same code on tiny sizes in about a minute (no goals).
`--parts=steps` runs only some parts (steps, link, host_optimizer, host_memory, lora).
Profiles run only when named: `templates`, the per-layer calls alone,
`host_optimizer_profile`, where the host AdamW's time goes (`--opt_slab` sets its
piece size, `--host_chunk` the in-place loop's chunk in both host-optimizer parts),
`attention`, dense against blockwise attention by sequence length (where
`attention_block="auto"` switches), `planner`, `scale_out`, `disk_tier`, the disk
tier against the host tier (`--state_dir` puts its files on the disk to measure), and
`disk_copies`, the disk tier with its copies on disk against them in RAM.
The process restarts once, before it imports JAX, with malloc asking for transparent
huge pages (see `megatrain_jax/launch.py`); `MEGATRAIN_HUGE_PAGES=0` measures without.
"""

from megatrain_jax import launch

launch.use_huge_pages()  # before anything imports JAX: may restart the process once

# pylint: disable=wrong-import-position
import json  # noqa: E402

from absl import app, flags, logging  # noqa: E402

from megatrain_jax import bench  # noqa: E402
from megatrain_jax.models.config import LlamaConfig  # noqa: E402

flags.DEFINE_enum("suite", "cpu", ["cpu", "smoke"], "Which sizes to run.")
flags.DEFINE_string("out", "bench.json", "Where to write the JSON result.")
flags.DEFINE_integer("reps", None, "Timed repetitions per figure (default: the suite's).",
                     lower_bound=1)
flags.DEFINE_integer("opt_slab", None, "Parameters per piece in the host-optimizer "
                     "profile (default: the suite's).", lower_bound=1)
flags.DEFINE_integer("host_chunk", None, "Elements per step of the host AdamW's in-place "
                     "loop, in both host-optimizer parts (default: the engine's).",
                     lower_bound=1)
flags.DEFINE_list("parts", list(bench.DEFAULT_PARTS),
                  f"Parts of the suite to run, of {list(bench.PART_NAMES)}.")
flags.DEFINE_string("state_dir", None, "Where the `disk_tier` part writes its state files "
                    "(default: the temporary directory).")
FLAGS = flags.FLAGS

SUITES = {
    "cpu": bench.Suite(),
    "smoke": bench.Suite(
        model=LlamaConfig(vocab_size=260, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                          d_ff=128, max_seq_len=128),
        batch_size=2, seq_len=64, warmup=1, reps=3, opt_params=2**20, opt_slab=2**16,
        rss_model="small"),
}


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  logging.info("%s", launch.describe())
  suite = SUITES[FLAGS.suite]
  if FLAGS.reps is not None:
    suite.reps = FLAGS.reps
  if FLAGS.opt_slab is not None:
    suite.opt_slab = FLAGS.opt_slab
  if FLAGS.host_chunk is not None:
    suite.host_chunk = FLAGS.host_chunk
  suite.state_dir = FLAGS.state_dir
  try:
    result = bench.run_suite(suite, tuple(FLAGS.parts))
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  result["suite"] = FLAGS.suite
  with open(FLAGS.out, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2, sort_keys=True)
  for key in bench.GOALS:
    if key in result:
      logging.info("%-28s %.3f", key, result[key])
  logging.info("Wrote %s.", FLAGS.out)


if __name__ == "__main__":
  app.run(main)
