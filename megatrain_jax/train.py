"""The training loop behind `experiments/train.py`, importable from a notebook."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax
from absl import logging
from flax import nnx

from megatrain_jax import checkpoint as checkpoint_lib
from megatrain_jax import data as data_lib
from megatrain_jax import hf
from megatrain_jax import planner
from megatrain_jax import metrics as metrics_lib
from megatrain_jax import optim
from megatrain_jax.engine import EngineConfig, StreamingTrainer, memory
from megatrain_jax.models.config import LlamaConfig, preset
from megatrain_jax.models.llama import Llama
from megatrain_jax.resident import ResidentTrainer

ENGINES = ("streaming", "resident")
DATA_FORMATS = ("text", "jsonl", *data_lib.INSTRUCT_FORMATS)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class TrainConfig:
  """One training run. The defaults are the README's main job (tiny model, stdlib)."""

  workdir: str = "runs/default"
  model: str | LlamaConfig = "tiny"
  engine: str = "streaming"
  steps: int = 200
  batch_size: int | str = 16  # or "auto": the largest the planner says fits
  seq_len: int = 128
  lr: float = 3e-3
  warmup_steps: int = 20
  weight_decay: float = 0.01
  data: str = data_lib.STDLIB
  # text (plain files; .jsonl files by suffix), jsonl ({"text"} per line), alpaca, sharegpt.
  data_format: str = "text"
  overlong: str = "truncate"  # instruction records longer than seq_len + 1: or "drop"
  max_data_bytes: int | None = 4_000_000
  # A Hugging Face Llama/Qwen2/Mistral directory: its config, weights and tokenizer.
  hf_model_dir: str | None = None
  export_dir: str | None = None  # where to write the trained model in HF format
  seed: int = 0
  log_every: int = 10
  compute_dtype: str = "float32"
  # Streaming engine (see megatrain_jax.EngineConfig).
  prefetch_depth: int = 2
  checkpoint_every: int = 1
  grad_accum: int = 1
  stream_embed_head: bool = True
  optimizer_mode: str = "auto"
  device_budget_bytes: int | None = None
  nonfinite: str = "raise"
  host_threads: int | None = None  # threads of the fused host AdamW (None: one per CPU)
  # Checkpoints in <workdir>/checkpoints every `save_every` steps (0: none) and at
  # the end; the last `keep` are kept. Rerunning with the same workdir resumes.
  save_every: int = 100
  keep: int = 2
  # Host memory the preflight may plan for (None: what the kernel reports available).
  host_memory_limit_bytes: int | None = None
  progress: bool = True

  # Settings a resumed run must share with the run that wrote the checkpoint.
  RESUME_FIELDS = ("engine", "steps", "batch_size", "seq_len", "lr", "warmup_steps",
                   "weight_decay", "data", "data_format", "overlong", "max_data_bytes",
                   "seed", "compute_dtype", "hf_model_dir")

  def engine_config(self) -> EngineConfig:
    return EngineConfig(
        prefetch_depth=self.prefetch_depth, checkpoint_every=self.checkpoint_every,
        compute_dtype=DTYPES[self.compute_dtype], grad_accum=self.grad_accum,
        stream_embed_head=self.stream_embed_head, optimizer_mode=self.optimizer_mode,
        device_budget_bytes=self.device_budget_bytes, nonfinite=self.nonfinite,
        host_threads=self.host_threads)

  def model_config(self) -> LlamaConfig:
    if self.hf_model_dir:
      return hf.read_config(self.hf_model_dir)[0]
    return preset(self.model) if isinstance(self.model, str) else self.model

  def tokenizer(self):
    """The checkpoint's tokenizer.json with --hf_model_dir, else the byte tokenizer."""
    if self.hf_model_dir and os.path.exists(os.path.join(self.hf_model_dir, "tokenizer.json")):
      return data_lib.HFTokenizer(self.hf_model_dir)
    return data_lib.ByteTokenizer()

  def validate(self) -> None:
    cfg = self.model_config()
    if self.batch_size == "auto":
      if self.engine != "streaming":
        raise ValueError("--batch_size=auto plans for the streaming engine; give a number "
                         "with --engine=resident.")
    elif not isinstance(self.batch_size, int):
      raise ValueError(f"--batch_size must be a positive integer or 'auto', got "
                       f"{self.batch_size!r}.")
    for name in ("steps", "seq_len", "log_every", "keep") + (
        () if self.batch_size == "auto" else ("batch_size",)):
      if getattr(self, name) <= 0:
        raise ValueError(f"--{name} must be positive, got {getattr(self, name)}.")
    if self.save_every < 0:
      raise ValueError(f"--save_every must be >= 0 (0: no checkpoints), got "
                       f"{self.save_every}.")
    if self.engine == "resident" and self.nonfinite != "raise":
      raise ValueError("--nonfinite=skip needs --engine=streaming; the resident trainer "
                       "raises on a non-finite step (and changes nothing).")
    if self.seq_len > cfg.max_seq_len:
      raise ValueError(f"--seq_len={self.seq_len} exceeds the model's max_seq_len="
                       f"{cfg.max_seq_len}; lower --seq_len or pick a larger --model.")
    if self.engine not in ENGINES:
      raise ValueError(f"--engine={self.engine!r} is not one of {ENGINES}.")
    if self.compute_dtype not in DTYPES:
      raise ValueError(f"--compute_dtype={self.compute_dtype!r} is not one of "
                       f"{sorted(DTYPES)}.")
    if self.engine == "streaming":
      self.engine_config()  # validates the engine fields
      if self.batch_size != "auto" and self.batch_size % self.grad_accum:
        raise ValueError(f"--batch_size={self.batch_size} is not divisible by "
                         f"--grad_accum={self.grad_accum}.")
    if not self.lr > 0:
      raise ValueError(f"--lr must be positive, got {self.lr}.")
    if self.data_format not in DATA_FORMATS:
      raise ValueError(f"--data_format={self.data_format!r} is not one of {DATA_FORMATS}.")
    if self.overlong not in data_lib.instruct.OVERLONG:
      raise ValueError(f"--overlong={self.overlong!r} is not one of "
                       f"{data_lib.instruct.OVERLONG}.")


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
  warmup = min(tc.warmup_steps, tc.steps // 2)
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, tc.lr, warmup, max(tc.steps, warmup + 1), end_value=0.1 * tc.lr)
  # optax.adamw, which the streaming engine runs fused and in parallel on the host.
  return optim.adamw(schedule, b1=0.9, b2=0.95, weight_decay=tc.weight_decay)


def make_trainer(tc: TrainConfig, cfg: LlamaConfig):
  """The trainer `tc.engine` names; both start from the same parameters for a seed."""
  key = jax.random.key(tc.seed)
  if tc.hf_model_dir and tc.engine == "streaming":
    return StreamingTrainer.from_pretrained(tc.hf_model_dir, make_optimizer(tc),
                                            tc.engine_config())
  if tc.engine == "streaming":
    return StreamingTrainer.from_config(cfg, make_optimizer(tc), tc.engine_config(), key)
  if tc.hf_model_dir:
    model = hf.from_pretrained(tc.hf_model_dir)[1]
  else:
    model = Llama(cfg, rngs=nnx.Rngs(params=key))
  return ResidentTrainer(model, make_optimizer(tc), compute_dtype=DTYPES[tc.compute_dtype])


def auto_batch_size(tc: TrainConfig, cfg: LlamaConfig) -> int:
  """The largest batch the planner says fits the device (the budget, the accelerator,
  or on the CPU backend the host RAM the rest of the run leaves)."""
  ec = tc.engine_config()
  limit = ec.device_budget_bytes or memory.accelerator_bytes()
  if limit is None:
    host = memory.host_bytes(cfg, make_optimizer(tc), ec)["total"]
    limit = (tc.host_memory_limit_bytes or memory.available_host_bytes()) - host
  batch = planner.largest_batch(cfg, ec, max(limit, 0), tc.seq_len,
                                flash_attention=jax.devices()[0].platform != "cpu")
  if batch == 0:
    raise ValueError(f"Not even one sequence of {tc.seq_len} tokens fits in "
                     f"{limit / 2**30:.2f} GiB of device memory; shorten --seq_len.")
  logging.info("--batch_size=auto: %d sequences of %d tokens fit in %.2f GiB.", batch,
               tc.seq_len, limit / 2**30)
  return batch


def make_dataset(tc: TrainConfig, cfg: LlamaConfig) -> data_lib.PackedDataset:
  """Batches of `tc.data` in `tc.data_format`, tokenized for the model."""
  tok = tc.tokenizer()
  if tok.vocab_size > cfg.vocab_size:
    raise ValueError(f"The tokenizer has {tok.vocab_size} ids but the model's vocab_size "
                     f"is {cfg.vocab_size}; use a larger model or the model's own tokenizer.")
  if tc.data_format in data_lib.INSTRUCT_FORMATS:
    convs = data_lib.read_conversations(tc.data, tc.data_format)
    windows, mask = data_lib.build_sequences(convs, tok, tc.seq_len, tc.overlong)
    return data_lib.PackedDataset(windows, tc.batch_size, tc.seed, mask)
  docs = data_lib.read_documents(tc.data, max_bytes=tc.max_data_bytes,
                                 jsonl=True if tc.data_format == "jsonl" else None)
  return data_lib.PackedDataset(data_lib.pack(docs, tc.seq_len, tok), tc.batch_size, tc.seed)


def export(tc: TrainConfig, cfg: LlamaConfig, trainer) -> None:
  """Writes the trained model to `tc.export_dir` in Hugging Face format."""
  arch, extra = None, None
  if tc.hf_model_dir:
    _, arch, extra = hf.read_config(tc.hf_model_dir)
  hf.save_pretrained(trainer, cfg, tc.export_dir, architecture=arch, extra_config=extra)
  if tc.hf_model_dir:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "special_tokens_map.json", "generation_config.json"):
      src = os.path.join(tc.hf_model_dir, name)
      if os.path.exists(src):
        shutil.copyfile(src, os.path.join(tc.export_dir, name))


def preflight(tc: TrainConfig, cfg: LlamaConfig) -> dict[str, dict[str, int]]:
  """Host and device bytes the run needs; refuses (ValueError) a run that cannot fit."""
  resident = tc.engine == "resident"
  plan = memory.check_fits(cfg, make_optimizer(tc), None if resident else tc.engine_config(),
                           tc.batch_size, tc.seq_len, host_limit=tc.host_memory_limit_bytes,
                           resident=resident)
  logging.info("Memory plan: host %.3f GiB, device %.3f GiB (available host: %.1f GiB).",
               plan["host"]["total"] / memory.GiB, plan["device"]["total"] / memory.GiB,
               (tc.host_memory_limit_bytes or memory.available_host_bytes()) / memory.GiB)
  return plan


def checkpoint_settings(tc: TrainConfig, cfg: LlamaConfig) -> dict[str, dict[str, Any]]:
  """What a checkpoint records and a resume compares."""
  return {"model": cfg.to_dict(), "run": {k: getattr(tc, k) for k in tc.RESUME_FIELDS}}


def run(tc: TrainConfig) -> list[dict[str, Any]]:
  """Trains as `tc` says; writes metrics.jsonl, loss.png and checkpoints in `tc.workdir`.

  Running it again with the same workdir resumes from the latest complete
  checkpoint; the steps after it are logged exactly as an uninterrupted run's.
  """
  tc.validate()
  cfg = tc.model_config()
  if tc.batch_size == "auto":
    tc = dataclasses.replace(tc, batch_size=auto_batch_size(tc, cfg))
  dataset = make_dataset(tc, cfg)
  logging.info("Model %s: %.2fM parameters; %d sequences of %d tokens; engine=%s.",
               tc.hf_model_dir or (tc.model if isinstance(tc.model, str) else "custom"),
               cfg.param_count() / 1e6, len(dataset.windows), tc.seq_len, tc.engine)
  preflight(tc, cfg)
  os.makedirs(tc.workdir, exist_ok=True)
  trainer = make_trainer(tc, cfg)
  ckpt = (checkpoint_lib.CheckpointManager(os.path.join(tc.workdir, "checkpoints"), tc.keep)
          if tc.save_every else None)
  metrics_path = os.path.join(tc.workdir, "metrics.jsonl")
  try:
    start = _resume(tc, cfg, trainer, ckpt, dataset, metrics_path)
    if start < tc.steps:
      _loop(tc, cfg, dataset, trainer, ckpt, start)
      if tc.export_dir:
        export(tc, cfg, trainer)
    else:
      logging.info("The checkpoint in %s is at step %d: training is complete "
                   "(--steps=%d). Use a new --workdir to train again.",
                   tc.workdir, start, tc.steps)
  finally:
    try:
      if ckpt is not None:
        ckpt.close()
    finally:
      if hasattr(trainer, "close"):
        trainer.close()
  records = metrics_lib.read_metrics(metrics_path)
  metrics_lib.plot_loss(records, os.path.join(tc.workdir, "loss.png"),
                        title=f"{tc.model if isinstance(tc.model, str) else 'custom'} "
                              f"({tc.engine})")
  logging.info("Wrote %s and loss.png.", metrics_path)
  return records


def _resume(tc, cfg, trainer, ckpt, dataset, metrics_path) -> int:
  """Restores the latest checkpoint (if any); returns the step it holds."""
  meta = ckpt.restore_latest(trainer, checkpoint_settings(tc, cfg)) if ckpt else None
  if meta is None:
    if os.path.exists(metrics_path):
      os.remove(metrics_path)
    return 0
  start = meta["step"]
  dataset.position = data_lib.DataPosition(**meta["data_position"])
  # Records past the checkpoint came from the interrupted run; they are redone.
  kept = [r for r in metrics_lib.read_metrics(metrics_path) if r["step"] <= start] \
      if os.path.exists(metrics_path) else []
  with open(metrics_path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in kept)
  logging.info("Resumed from step %d (data epoch %d, batch %d).", start,
               dataset.position.epoch, dataset.position.index)
  return start


def _loop(tc: TrainConfig, cfg: LlamaConfig, dataset, trainer, ckpt, start: int) -> None:
  flops_per_token = metrics_lib.model_flops_per_token(cfg, tc.seq_len)
  settings = checkpoint_settings(tc, cfg)
  bar = None
  if tc.progress:
    from tqdm import tqdm
    bar = tqdm(total=tc.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
  with metrics_lib.MetricsWriter(tc.workdir, append=True) as writer:
    for step in range(start + 1, tc.steps + 1):
      batch = dataset.next_batch()
      t0 = time.perf_counter()
      m = trainer.step(batch)
      dt = time.perf_counter() - t0
      if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{m['loss']:.3f}")
      if step == 1 or step % tc.log_every == 0 or step == tc.steps:
        record = {"step": step, "loss": m["loss"], "grad_norm": m.get("grad_norm"),
                  "step_time_s": dt, "tokens_per_s": m["tokens"] / dt,
                  "model_tflops_per_s": flops_per_token * m["tokens"] / dt / 1e12}
        if hasattr(trainer, "stats"):
          record["skipped_steps"] = trainer.stats()["skipped_steps"]
        writer.write(record)
        logging.info("step %d  loss %.4f  %.0f tok/s", step, m["loss"],
                     record["tokens_per_s"])
      if ckpt is not None and (step % tc.save_every == 0 or step == tc.steps):
        ckpt.save(trainer, {**settings,
                            "data_position": dataclasses.asdict(dataset.position)})
  if hasattr(trainer, "wait"):
    trainer.wait()  # the last step's last updates, and anything they found
  if bar is not None:
    bar.close()
