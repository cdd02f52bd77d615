"""Training with the optimizer state on disk, on a model whose state does not fit RAM.

  python experiments/beyond_ram.py --state_dir=/nvme/state          # 2x this machine's RAM
  python experiments/beyond_ram.py --state_dir=/nvme/state --stream_copy=disk  # copies too
  python experiments/beyond_ram.py --state_dir=/nvme/state --ram_factor=0.5 \\
      --checkpoint_dir=/nvme/ckpt                                   # and resume from a save

Sizes a model (d_model 3072, the byte vocabulary) so that its training state in RAM
(fp32 masters and AdamW moments, as the planner counts the host tier) needs
`--ram_factor` times this machine's RAM, trains `--steps` steps of one sequence with the
state on disk (`state_tier="disk"`, bf16 compute), and logs the peak RSS, the state
files' bytes and each step's time beside the disk's busy time, the prefetcher's and the
gradient thread's time and the host update's. With `--checkpoint_dir` it then saves, takes one more step, and checks that
a new trainer restored from the save takes that step with the same loss. A checkpoint
is as large as the state files: the disk needs room for both. docs/performance.md,
"Beyond this machine's RAM", has a run.
"""

from megatrain_jax import launch

launch.use_huge_pages()  # before anything imports JAX: may restart the process once

# pylint: disable=wrong-import-position
import os  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from megatrain_jax import checkpoint as ckpt_lib  # noqa: E402
from megatrain_jax.bench.host_memory import peak_rss_bytes  # noqa: E402
from megatrain_jax.bench.timing import synthetic_batch  # noqa: E402
from megatrain_jax.engine import EngineConfig, StreamingTrainer  # noqa: E402
from megatrain_jax.engine.plan import memory  # noqa: E402
from megatrain_jax.models.config import LlamaConfig  # noqa: E402
from megatrain_jax.optim import adamw  # noqa: E402

flags.DEFINE_string("state_dir", None, "Where the state files go (a fast disk).", required=True)
flags.DEFINE_float("ram_factor", 2.0, "The in-RAM state's size over this machine's RAM.",
                   lower_bound=0.01)
flags.DEFINE_integer("steps", 3, "Training steps.", lower_bound=1)
flags.DEFINE_integer("seq_len", 64, "Tokens of the one sequence a step trains on.",
                     lower_bound=8)
flags.DEFINE_string("checkpoint_dir", None, "Save after the steps, then resume from it.")
flags.DEFINE_float("state_piece_mb", EngineConfig.state_piece_mb, "MiB of master in a piece "
                   "of a unit's state streamed through its update.", lower_bound=1e-3)
flags.DEFINE_enum("stream_copy", "auto", ["auto", "disk"], "Where the bf16 copies live: "
                  "auto (RAM), or disk (files beside the state, read at each fetch).")
FLAGS = flags.FLAGS

WIDTH = LlamaConfig(vocab_size=260, d_model=3072, n_layers=1, n_heads=24, n_kv_heads=8,
                    d_ff=8192, max_seq_len=2048)


def machine_ram() -> int:
  """This machine's RAM in bytes (MemTotal)."""
  with open("/proc/meminfo") as f:
    return int(f.readline().split()[1]) * 1024


def sized(factor: float) -> LlamaConfig:
  """The `WIDTH` model with the fewest layers whose host-tier state needs `factor` x RAM."""
  need = factor * machine_ram()
  per_layer = 12 * WIDTH.block_param_count(0)
  return WIDTH.replace(n_layers=max(1, int(np.ceil(need / per_layer))))


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  logging.info("%s", launch.describe())
  cfg, opt = sized(FLAGS.ram_factor), adamw(1e-4)
  ec = EngineConfig(compute_dtype=jnp.bfloat16, state_tier="disk", state_dir=FLAGS.state_dir,
                    state_piece_mb=FLAGS.state_piece_mb, stream_copy=FLAGS.stream_copy)
  in_ram = memory.host_bytes(cfg, opt, EngineConfig(compute_dtype=jnp.bfloat16))
  logging.info("Model: %d layers, %.2fB parameters; its state in RAM would take %.1f GiB "
               "(masters %.1f, optimizer state %.1f) on a machine with %.1f GiB.",
               cfg.n_layers, cfg.param_count() / 1e9, in_ram["total"] / 2**30,
               in_ram["masters"] / 2**30, in_ram["optimizer_state"] / 2**30,
               machine_ram() / 2**30)
  batches = [synthetic_batch(cfg, 1, FLAGS.seq_len, seed=s) for s in range(FLAGS.steps + 1)]
  t0 = time.perf_counter()
  trainer = StreamingTrainer.from_config(cfg, opt, ec, jax.random.key(0))
  store = trainer.host_optimizer.store
  logging.info("Built in %.0f s: %.1f GiB of state files; peak RSS so far %.2f GiB.",
               time.perf_counter() - t0, store.disk_bytes() / 2**30, peak_rss_bytes() / 2**30)
  for i in range(FLAGS.steps):
    before, t0 = store.io_stats(), time.perf_counter()
    out = trainer.step(batches[i])
    trainer.wait()
    store.flush()
    dt, after, last = time.perf_counter() - t0, store.io_stats(), trainer.stats()["last_step"]
    moved = lambda k: (after.get(k, 0) - before.get(k, 0)) / 2**30
    logging.info("step %d: loss %.4f, %.1f s; disk busy %.1f s (state: %.1f GiB read, %.1f "
                 "GiB written; copies: %.1f GiB read, %.1f GiB written); fetches issued "
                 "%.1f s; gradient thread %.1f s (its wait for the compute included); host "
                 "update %.1f s; peak RSS %.2f GiB", i + 1, float(out["loss"]), dt,
                 after["busy_s"] - before["busy_s"], moved("read_bytes"),
                 moved("write_bytes"), moved("copy_read_bytes"), moved("copy_write_bytes"),
                 last["h2d_s"], last["d2h_s"], last["host_opt_s"], peak_rss_bytes() / 2**30)
    if not np.isfinite(float(out["loss"])):
      raise FloatingPointError(f"Loss {float(out['loss'])} at step {i + 1}.")
  if FLAGS.checkpoint_dir:
    settings = {"model": cfg.to_dict()}
    mgr = ckpt_lib.CheckpointManager(FLAGS.checkpoint_dir)
    mgr.save(trainer, settings)
    want = float(trainer.step(batches[-1])["loss"])
    mgr.wait()
    trainer.close()
    os.sync()
    resumed = StreamingTrainer.from_config(cfg, opt, ec, jax.random.key(1))
    ckpt_lib.CheckpointManager(FLAGS.checkpoint_dir).restore_latest(resumed, settings)
    got = float(resumed.step(batches[-1])["loss"])
    resumed.close()
    logging.info("Resumed from step %d: loss %.6f, the uninterrupted run's %.6f (%s).",
                 FLAGS.steps, got, want, "equal" if got == want else "DIFFERENT")
    if got != want:
      raise RuntimeError("The resumed run's loss differs from the uninterrupted run's.")
  else:
    trainer.close()
  logging.info("Peak RSS %.2f GiB.", peak_rss_bytes() / 2**30)


if __name__ == "__main__":
  app.run(main)
