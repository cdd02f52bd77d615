"""Figure 2: throughput (model TFLOPS) vs model size on H200 and GH200.

  python experiments/figures/throughput.py --out_dir=figures   # about a minute

Predicted: the planner at the largest batch that fits, capped at 64K tokens per step,
bf16 compute, for 7B..200B on the `h200` and `gh200` profiles. Measured: model TFLOPS
of the streaming engine on this machine for small presets.
"""

from megatrain_jax import launch

launch.use_huge_pages()  # before anything imports JAX: may restart the process once

from megatrain_jax import figures  # noqa: E402  pylint: disable=wrong-import-position

if __name__ == "__main__":
  figures.run_script("throughput")
