"""Side-by-side measurements behind `experiments/bench.py`, one module per measurement.

`timing` holds what every measurement shares (medians after warm-up, synthetic
batches, host buffers); `suite` the sizes and the goals; `run` the parts by name.
"""

from megatrain_jax.bench.run import DEFAULT_PARTS, PART_NAMES, parts, run_suite
from megatrain_jax.bench.suite import BENCH_MODEL, GOALS, Suite, machine
from megatrain_jax.bench.timing import median_time, median_times, steady_step_times, \
    synthetic_batch
