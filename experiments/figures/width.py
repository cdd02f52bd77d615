"""Figure 4: width scaling at fixed depth.

  python experiments/figures/width.py --out_dir=figures   # a few minutes

Predicted: 32 layers, d_model 2048 to 12288 (d_ff = 2.6875 x d), on `h200` and `gh200`,
batch 8 x 4096. Measured: 4 layers, d_model 64 to 256, on this machine.
"""

from megatrain_jax import launch

launch.use_huge_pages()  # before anything imports JAX: may restart the process once

from megatrain_jax import figures  # noqa: E402  pylint: disable=wrong-import-position

if __name__ == "__main__":
  figures.run_script("width")
