"""Figure 5: sequence length 1K -> 512K for a 7B model on GH200: batch, step time, device memory.

  python experiments/figures/seqlen.py --out_dir=figures   # about a minute

Predicted: for each length, the smallest checkpoint_every (1, 2, 4, 8, 16, 32) at
which one sequence fits, then the largest batch at that setting, on `gh200`. Where
nothing fits, the row says so. Measured: a tiny model on this machine from 64 to 1024
tokens at a fixed 4K tokens per step.
"""

from megatrain_jax import launch

launch.use_huge_pages()  # before anything imports JAX: may restart the process once

from megatrain_jax import figures  # noqa: E402  pylint: disable=wrong-import-position

if __name__ == "__main__":
  figures.run_script("seqlen")
