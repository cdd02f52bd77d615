r"""Figure 7's runs: the tiny model on stdlib text, every step logged, no checkpoint.

  python experiments/train.py --config=experiments/configs/convergence.py
  python experiments/train.py --config=experiments/configs/convergence.py \
      --config.trainer=resident --config.workdir=figures/convergence_resident

The first is the figure's streaming curve, the second its resident one (the figure
script, `python experiments/figures/convergence.py`, runs both and draws them; the
other figures measure steps and plans, not launcher runs: `docs/figures.md`, which
gives the pair's time, 206 s on 2 CPU cores); the two curves agree to rounding (fp32).
"""

from megatrain_jax import configs
from megatrain_jax.figures import convergence


def get_config():
  return configs.config_dict(convergence.train_config("streaming"))
