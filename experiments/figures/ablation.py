"""Figure 6: the double-buffering ablation, measured under a simulated link and predicted.

  python experiments/figures/ablation.py --out_dir=figures   # a few minutes

Measured: step time with prefetch_depth 0, 1, 2 under a `SimulatedLink` set so one
layer's transfer takes about as long as its backward compute. Predicted: the same
depths for 14B on `h200` at 8 x 4096 tokens and at 1 x 1024 tokens (link-bound).
The paper lost 31% without double buffering.
"""

from megatrain_jax import launch

launch.use_huge_pages()  # before anything imports JAX: may restart the process once

from megatrain_jax import figures  # noqa: E402  pylint: disable=wrong-import-position

if __name__ == "__main__":
  figures.run_script("ablation")
