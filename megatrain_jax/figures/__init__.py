"""The paper's figures, reproduced: measured on the machine at hand, predicted at paper scale.

Each module has `make(out_dir, quick=False)`, which writes `<name>.csv` and
`<name>.png`; `experiments/figures/<name>.py` runs it with absl flags.
"""

from megatrain_jax.figures import (ablation, convergence, depth, host_memory, seqlen,
                                   throughput, width)

FIGURES = {m.__name__.rsplit(".", 1)[1]: m for m in
           (host_memory, throughput, depth, width, seqlen, ablation, convergence)}


def run_script(name: str) -> None:
  """The body of `experiments/figures/<name>.py`: --out_dir and --quick, then make().

  Defines the two flags and runs the figure's `make` under `absl.app` (the script
  calls `launch.use_huge_pages()` before it imports this package).

  Args:
    name: the figure, a key of `FIGURES`.
  """
  from absl import app, flags, logging  # pylint: disable=import-outside-toplevel
  from megatrain_jax import launch  # pylint: disable=import-outside-toplevel

  flags.DEFINE_string("out_dir", "figures", "Where the PNG and CSV go.")
  flags.DEFINE_bool("quick", False, "Fewer measured points (for tests).")

  def main(argv):
    del argv
    logging.info("%s", launch.describe())
    csv_path, png_path = FIGURES[name].make(flags.FLAGS.out_dir, flags.FLAGS.quick)
    logging.info("Wrote %s and %s.", csv_path, png_path)

  app.run(main)
