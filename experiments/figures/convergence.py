"""Figure 7: convergence parity, streaming vs resident training on the same data (measured).

  python experiments/figures/convergence.py --out_dir=figures   # about 4 minutes

Both trainers start from the same parameters and see the same batches of stdlib
text; the curves overlay (fp32 on CPU they agree to rounding).
"""

from absl import app, flags

from megatrain_jax.figures import convergence

flags.DEFINE_string("out_dir", "figures", "Where the PNG and CSV go.")
flags.DEFINE_bool("quick", False, "Fewer measured points (for tests).")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  convergence.make(FLAGS.out_dir, FLAGS.quick)


if __name__ == "__main__":
  app.run(main)
