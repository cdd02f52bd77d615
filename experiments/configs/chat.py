"""Supervised fine-tuning on the bundled chat sample (395 sharegpt conversations about
the Python standard library), packed, with a held-out loss.

  python experiments/train.py --config=experiments/configs/chat.py

The tiny model from scratch on 512-token rows (159 packed rows, 95% non-padding),
blockwise attention, 5% of the conversations held out and evaluated every 25 steps.
About 3 minutes on 2 CPU cores; see the docstring's numbers in docs/hf.md.
"""

from megatrain_jax import configs
from megatrain_jax.train_config import TrainConfig


def get_config():
  return configs.config_dict(TrainConfig(
      workdir="runs/chat", data="chat_sample", data_format="sharegpt", seq_len=511,
      attention_block=128, batch_size=8, steps=100, warmup_steps=10, log_every=5,
      eval_every=25, eval_batches=2))
