"""Figure 1: host memory vs model size, with the paper's 1.5 TB line.

  python experiments/figures/host_memory.py --out_dir=figures   # seconds

Predicted: the planner's host bytes by kind (fp32 masters, AdamW moments, gradient
buffers, bf16 pinned copies) for Llama-shaped models from 7B to 200B. Measured: the
bytes the engine allocates on this machine for small presets (masters, optimizer state,
streaming copies), beside the planner's count for the same configs.
"""

from megatrain_jax import launch

launch.use_huge_pages()  # before anything imports JAX: may restart the process once

from megatrain_jax import figures  # noqa: E402  pylint: disable=wrong-import-position

if __name__ == "__main__":
  figures.run_script("host_memory")
