"""The paper's figures, reproduced: measured on the machine at hand, predicted at paper scale.

Each module has `make(out_dir, quick=False)`, which writes `<name>.csv` and
`<name>.png`; `experiments/figures/<name>.py` runs it with absl flags.
"""

from megatrain_jax.figures import (ablation, convergence, depth, host_memory, seqlen,
                                   throughput, width)

FIGURES = {m.__name__.rsplit(".", 1)[1]: m for m in
           (host_memory, throughput, depth, width, seqlen, ablation, convergence)}
