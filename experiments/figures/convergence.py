"""Figure 7: convergence parity, streaming vs resident training on the same data (measured).

  python experiments/figures/convergence.py --out_dir=figures   # about 4 minutes

Both trainers start from the same parameters and see the same batches of stdlib
text; the curves overlay (fp32 on CPU they agree to rounding).
"""

from megatrain_jax import launch

launch.use_huge_pages()  # before anything imports JAX: may restart the process once

from megatrain_jax import figures  # noqa: E402  pylint: disable=wrong-import-position

if __name__ == "__main__":
  figures.run_script("convergence")
