"""LoRA on a frozen base: rank-8 adapters on every projection, trained on the chat
sample, exported in PEFT's format.

  python experiments/train.py --config.workdir=runs/base --config.export_dir=runs/base/hf
  python experiments/train.py --config=experiments/configs/lora.py

The first command trains the default model and writes it as a Hugging Face
checkpoint; the second fine-tunes adapters on it (the base stays frozen on the host
in the compute dtype, with no master, optimizer state or gradient) and writes them
to runs/lora/adapter. On 2 CPU cores: 73 s, then 63 s for 60 steps of 8 x 511 tokens;
the training loss falls from 3.14 to 2.85 and the held-out loss from 3.00 (step 20)
to 2.91 (step 60). Point --config.hf_model_dir at any local Llama-family checkpoint
instead (docs/hf.md, "LoRA").
"""

from megatrain_jax import configs
from megatrain_jax.train_config import TrainConfig


def get_config():
  return configs.config_dict(TrainConfig(
      workdir="runs/lora", hf_model_dir="runs/base/hf", data="chat_sample",
      data_format="sharegpt", seq_len=511, attention_block=128, batch_size=8, steps=60,
      warmup_steps=5, lr=1e-3, log_every=5, lora_rank=8, lora_alpha=16,
      export_adapter_dir="runs/lora/adapter", eval_every=20, eval_batches=2))
