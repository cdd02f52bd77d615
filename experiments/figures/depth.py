"""Figure 3: depth scaling at fixed width: throughput and device memory.

  python experiments/figures/depth.py --out_dir=figures   # a few minutes

Predicted: a 7B-wide model (d=4096) from 28 to 180 layers on `h200`, batch 8 x 4096.
Measured: a narrow model on this machine from 2 to 16 layers; the device peak stays
flat because only a few layers are ever on the device.
"""

from megatrain_jax import launch

launch.use_huge_pages()  # before anything imports JAX: may restart the process once

from megatrain_jax import figures  # noqa: E402  pylint: disable=wrong-import-position

if __name__ == "__main__":
  figures.run_script("depth")
