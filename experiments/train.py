"""Trains a Llama-family model.

  python experiments/train.py                      # tiny model on stdlib text, ~1 min on 2 CPU cores
  python experiments/train.py --model=small --steps=1000 --workdir=runs/small
  python experiments/train.py --hf_model_dir=path/to/llama --data=chat.jsonl \
      --data_format=sharegpt --export_dir=runs/sft/hf   # fine-tune a local HF checkpoint

Writes <workdir>/metrics.jsonl (one JSON object per logged step), <workdir>/loss.png
and checkpoints in <workdir>/checkpoints (every --save_every steps and at the end).
Running the same command again resumes from the latest complete checkpoint.
"""

from absl import app, flags, logging

from megatrain_jax import train as train_lib
from megatrain_jax.engine import host_memory

_D = train_lib.TrainConfig()
flags.DEFINE_string("workdir", _D.workdir, "Output directory.")
flags.DEFINE_string("model", _D.model, "Model size: one of megatrain_jax.PRESETS.")
flags.DEFINE_enum("engine", _D.engine, list(train_lib.ENGINES), "Trainer.")
flags.DEFINE_integer("steps", _D.steps, "Training steps.")
flags.DEFINE_string("batch_size", str(_D.batch_size), "Sequences per step, or 'auto': the largest the planner says fits the device.")
flags.DEFINE_integer("seq_len", _D.seq_len, "Tokens per sequence.")
flags.DEFINE_float("lr", _D.lr, "Peak learning rate (warmup, then cosine decay).")
flags.DEFINE_integer("warmup_steps", _D.warmup_steps, "Linear warmup steps.")
flags.DEFINE_string("data", _D.data, "Comma-separated files/directories, or 'stdlib'.")
flags.DEFINE_enum("data_format", _D.data_format, list(train_lib.DATA_FORMATS), "text: plain files (.jsonl by suffix); jsonl: {\"text\"} per line; alpaca; sharegpt.")
flags.DEFINE_enum("overlong", _D.overlong, ["truncate", "drop"], "Instruction records longer than seq_len + 1.")
flags.DEFINE_string("hf_model_dir", None, "Hugging Face Llama/Qwen2/Mistral checkpoint directory to fine-tune (config, safetensors, tokenizer).")
flags.DEFINE_string("export_dir", None, "Write the trained model here in Hugging Face format.")
flags.DEFINE_integer("max_data_bytes", _D.max_data_bytes, "Stop reading data after this many bytes.")
flags.DEFINE_integer("seed", _D.seed, "Seed for init and data order.")
flags.DEFINE_integer("log_every", _D.log_every, "Log every N steps.")
flags.DEFINE_enum("compute_dtype", _D.compute_dtype, list(train_lib.DTYPES), "Compute dtype; masters stay fp32.")
flags.DEFINE_integer("prefetch_depth", _D.prefetch_depth, "Streaming: units fetched ahead of compute.")
flags.DEFINE_integer("checkpoint_every", _D.checkpoint_every, "Streaming: keep a block input every N layers.")
flags.DEFINE_integer("grad_accum", _D.grad_accum, "Streaming: micro-batches per step.")
flags.DEFINE_bool("stream_embed_head", _D.stream_embed_head, "Streaming: fetch embedding/head when used (else keep them on the device).")
flags.DEFINE_enum("optimizer_mode", _D.optimizer_mode, ["auto", "per_unit", "whole_tree"], "Streaming: host optimizer mode.")
flags.DEFINE_integer("device_budget_mb", None, "Streaming: refuse configs needing more device memory (MiB).")
flags.DEFINE_enum("nonfinite", _D.nonfinite, ["raise", "skip"], "Streaming: a NaN/inf loss or gradient raises, or skips the step.")
flags.DEFINE_integer("host_threads", None, "Streaming: threads of the fused host AdamW update (default: one per CPU).", lower_bound=1)
flags.DEFINE_integer("save_every", _D.save_every, "Checkpoint every N steps (0: never); rerunning resumes.")
flags.DEFINE_integer("keep", _D.keep, "Complete checkpoints to keep.")
flags.DEFINE_integer("host_memory_limit_mb", None, "Host memory the preflight may plan for (default: what is available).")
FLAGS = flags.FLAGS


def _int(text: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise app.UsageError(f"--batch_size must be an integer or 'auto', got {text!r}.") from None


def main(argv):
  del argv
  host_memory.use_huge_pages()  # first: may restart the process once, see its docstring
  logging.set_verbosity(logging.INFO)
  tc = train_lib.TrainConfig(
      workdir=FLAGS.workdir, model=FLAGS.model, engine=FLAGS.engine, steps=FLAGS.steps,
      batch_size=FLAGS.batch_size if FLAGS.batch_size == "auto" else _int(FLAGS.batch_size), seq_len=FLAGS.seq_len, lr=FLAGS.lr,
      warmup_steps=FLAGS.warmup_steps, data=FLAGS.data, max_data_bytes=FLAGS.max_data_bytes,
      data_format=FLAGS.data_format, overlong=FLAGS.overlong,
      hf_model_dir=FLAGS.hf_model_dir, export_dir=FLAGS.export_dir,
      seed=FLAGS.seed, log_every=FLAGS.log_every, compute_dtype=FLAGS.compute_dtype,
      prefetch_depth=FLAGS.prefetch_depth, checkpoint_every=FLAGS.checkpoint_every,
      grad_accum=FLAGS.grad_accum, stream_embed_head=FLAGS.stream_embed_head,
      optimizer_mode=FLAGS.optimizer_mode, nonfinite=FLAGS.nonfinite,
      host_threads=FLAGS.host_threads,
      device_budget_bytes=(FLAGS.device_budget_mb * 2**20 if FLAGS.device_budget_mb else None),
      save_every=FLAGS.save_every, keep=FLAGS.keep,
      host_memory_limit_bytes=(FLAGS.host_memory_limit_mb * 2**20
                               if FLAGS.host_memory_limit_mb else None))
  try:
    train_lib.run(tc)
  except (ValueError, FileNotFoundError) as e:
    raise app.UsageError(str(e)) from None


if __name__ == "__main__":
  app.run(main)
