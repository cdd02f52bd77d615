"""The training loop behind `experiments/train.py`, importable from a notebook."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any


import jax
import optax
from absl import logging
from flax import nnx

from megatrain_jax import checkpoint as checkpoint_lib
from megatrain_jax import data as data_lib
from megatrain_jax import distributed
from megatrain_jax import hf
from megatrain_jax import lora
from megatrain_jax import planner
from megatrain_jax import progress
from megatrain_jax import metrics as metrics_lib
from megatrain_jax import optim
from megatrain_jax.engine import StreamingTrainer
from megatrain_jax.protocol import Trainer
from megatrain_jax.engine.plan import memory
from megatrain_jax.engine.plan import pinned
from megatrain_jax.engine import platform
from megatrain_jax.engine.plan import preflight as preflight_lib
from megatrain_jax.models.config import COMPUTE_FIELDS, LlamaConfig
from megatrain_jax.models.llama import Llama
from megatrain_jax.models.params import init_adapters_tree
from megatrain_jax.resident import ResidentTrainer

from megatrain_jax.train_config import TrainConfig
from megatrain_jax.train_data import make_datasets, split_held_out  # noqa: F401  (the API)


def lr_schedule(tc: TrainConfig) -> optax.Schedule:
  """The run's learning rate: linear warmup, then cosine decay to a tenth.

  Args:
    tc: the run.

  Returns:
    The schedule; step s (1-based) applies `schedule(s - 1)`.
  """
  warmup = min(tc.warmup_steps, tc.steps // 2)
  return optax.warmup_cosine_decay_schedule(
      0.0, tc.lr, warmup, max(tc.steps, warmup + 1), end_value=0.1 * tc.lr)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
  """The run's optimizer: AdamW on `lr_schedule`.

  Args:
    tc: the run.

  Returns:
    `mt.optim.adamw` (optax.adamw, which the engine runs fused on the host).
  """
  return optim.adamw(lr_schedule(tc), b1=0.9, b2=0.95, weight_decay=tc.weight_decay)


def make_trainer(tc: TrainConfig, cfg: LlamaConfig):
  """The trainer `tc.trainer` names; both start from the same parameters for a seed.

  Args:
    tc: the run.
    cfg: its model.

  Returns:
    A `StreamingTrainer` (from the checkpoint or initialised on the host) or a
    `ResidentTrainer`.
  """
  key, trainable = jax.random.key(tc.seed), tc.trainable()
  if tc.hf_model_dir and tc.trainer == "streaming":
    return hf.streaming_trainer(tc.hf_model_dir, make_optimizer(tc), tc.streaming_config(),
                                compute=tc.compute(), lora=cfg.lora, key=key,
                                trainable=trainable)
  if tc.trainer == "streaming":
    return StreamingTrainer.from_config(cfg, make_optimizer(tc), tc.streaming_config(), key,
                                        trainable=trainable)
  if tc.hf_model_dir:
    model = hf.from_pretrained(tc.hf_model_dir, compute=tc.compute())[1]
    if cfg.lora is not None:  # the adapters the streaming trainer draws from `key`
      lora.replace_params(model, cfg, init_adapters_tree(cfg, model.param_tree(), key))
  else:
    model = Llama(cfg, rngs=nnx.Rngs(params=key))
  return ResidentTrainer(model, make_optimizer(tc), compute_dtype=tc.engine.compute_dtype,
                         trainable=trainable)


def auto_batch_size(tc: TrainConfig, cfg: LlamaConfig) -> int:
  """The largest batch the planner says fits the device.

  Args:
    tc: the run.
    cfg: its model.

  Returns:
    The batch size: under the budget, the accelerator's memory, or on the CPU
    backend the host RAM the rest of the run leaves.

  Raises:
    ValueError: not even one sequence fits.
  """
  ec = tc.engine
  limit = ec.device_budget_bytes or platform.accelerator_bytes()
  if limit is None:
    host = memory.host_bytes(cfg, make_optimizer(tc), ec)["total"]
    limit = (tc.host_memory_limit_bytes or platform.available_host_bytes()) - host
  batch = planner.largest_batch(cfg, ec, max(limit, 0), tc.seq_len,
                                flash_attention=jax.devices()[0].platform != "cpu")
  if batch == 0:
    raise ValueError(f"Not even one sequence of {tc.seq_len} tokens fits in "
                     f"{limit / 2**30:.2f} GiB of device memory; shorten --seq_len.")
  logging.info("--batch_size=auto: %d sequences of %d tokens fit in %.2f GiB.", batch,
               tc.seq_len, limit / 2**30)
  return batch


def evaluate(trainer: Trainer, dataset: data_lib.PackedDataset, batches: int
             ) -> dict[str, float]:
  """The held-out loss: the same batches every time, forward only.

  Args:
    trainer: either trainer.
    dataset: the held-out data (its position is reset).
    batches: how many batches (at most one epoch of the data: no row twice).

  Returns:
    {"eval_loss": the token-weighted mean loss, "eval_perplexity": its exp,
    "eval_tokens": the tokens it covers}.
  """
  dataset.position = data_lib.DataPosition()
  loss_sum = tokens = 0.0
  for _ in range(min(batches, dataset.batches_per_epoch)):
    m = trainer.evaluate(dataset.next_batch())
    loss_sum, tokens = loss_sum + m["loss"] * m["tokens"], tokens + m["tokens"]
  loss = loss_sum / max(tokens, 1.0)
  return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)),
          "eval_tokens": tokens}


def preflight(tc: TrainConfig, cfg: LlamaConfig) -> dict[str, dict[str, int]]:
  """Host and device bytes the run needs.

  Args:
    tc: the run.
    cfg: its model.

  Returns:
    {"host": bytes by kind, "device": bytes by kind}.

  Raises:
    ValueError: the run cannot fit (see `preflight.check_fits`).
  """
  resident = tc.trainer == "resident"
  plan = preflight_lib.check_fits(cfg, make_optimizer(tc),
                                  None if resident else tc.engine, tc.batch_size,
                                  tc.seq_len, host_limit=tc.host_memory_limit_bytes,
                                  resident=resident, trainable=tc.trainable())
  logging.info("Memory plan: host %.3f GiB, device %.3f GiB (available host: %.1f GiB).",
               plan["host"]["total"] / memory.GiB, plan["device"]["total"] / memory.GiB,
               (tc.host_memory_limit_bytes or platform.available_host_bytes()) / memory.GiB)
  return plan


def checkpoint_settings(tc: TrainConfig, cfg: LlamaConfig) -> dict[str, dict[str, Any]]:
  """What a checkpoint records and a resume compares.

  Args:
    tc: the run.
    cfg: its model.

  Returns:
    {"model": the config, "run": the settings a resume must share}. How the model
    computes (`COMPUTE_FIELDS`) may change on resume; packing is recorded when on.
  """
  run = {k: getattr(tc, k) for k in tc.RESUME_FIELDS}
  run["compute_dtype"] = tc.engine.dtype_name
  if tc.packs():
    run["pack"] = True
  model = {k: v for k, v in cfg.to_dict().items() if k not in COMPUTE_FIELDS}
  return {"model": model, "run": run}


def run(tc: TrainConfig, dc: distributed.DistributedConfig | None = None
        ) -> list[dict[str, Any]]:
  """Trains as `tc` says; writes metrics.jsonl, loss.png and checkpoints in `tc.workdir`.

  Running it again with the same workdir resumes from the latest complete
  checkpoint; the steps after it are logged exactly as an uninterrupted run's.
  In a run of several processes (`dc`, or a cluster launcher's environment) each
  trains on its share of every batch; process 0 writes the checkpoints and the
  export, process p > 0 its metrics in `<workdir>/process_<p>/`.

  Args:
    tc: the run.
    dc: how this process joins a run of several (default: from the environment).

  Returns:
    The metrics records, one per logged step.

  Raises:
    ValueError, OSError: bad input (a flag, data, a checkpoint), before anything is
      built where it can be checked.
  """
  tc.validate()
  cfg = tc.model_config()
  if tc.trainer == "streaming":
    # Before anything starts a JAX backend: XLA's GPU client reads the pinned-memory
    # limit once. An automatic batch size is not known yet: its copies only.
    batch = 0 if tc.batch_size == "auto" else tc.batch_size
    pinned.configure(pinned.pinned_bytes(cfg, tc.engine, batch, tc.seq_len))
  distributed.initialize(dc or distributed.DistributedConfig())
  index, count = jax.process_index(), jax.process_count()
  if count > 1 and tc.trainer != "streaming":
    raise ValueError(f"--config.trainer={tc.trainer} runs in one process; this run has "
                     f"{count}. Use --config.trainer=streaming, or start one process.")
  if tc.batch_size == "auto":
    tc = dataclasses.replace(tc, batch_size=auto_batch_size(tc, cfg) * count)
  dataset, held_out = make_datasets(tc, cfg, (index, count))
  logging.info("Model %s: %.2fM parameters; %d sequences of %d tokens%s%s; trainer=%s.",
               tc.hf_model_dir or (tc.model if isinstance(tc.model, str) else "custom"),
               cfg.param_count() / 1e6, len(dataset.windows), tc.seq_len,
               "" if dataset.non_padding is None else
               f", packed to {100 * dataset.non_padding:.1f}% non-padding tokens",
               "" if held_out is None else f", {len(held_out.windows)} held out", tc.trainer)
  if tc.trainer == "streaming":  # the disk tier's copies in RAM or on disk, decided once
    tc = dataclasses.replace(tc, engine=preflight_lib.resolve_stream_copy(
        cfg, make_optimizer(tc), tc.engine, tc.host_memory_limit_bytes,
        tc.batch_size // count, tc.seq_len, tc.trainable()))
  preflight(dataclasses.replace(tc, batch_size=tc.batch_size // count), cfg)
  os.makedirs(tc.workdir, exist_ok=True)
  trainer = make_trainer(tc, cfg)
  ckpt = (checkpoint_lib.CheckpointManager(os.path.join(tc.workdir, "checkpoints"), tc.keep)
          if tc.save_every else None)
  if index:  # one checkpoint and one export for the run; each process's own metrics
    tc = dataclasses.replace(tc, workdir=os.path.join(tc.workdir, f"process_{index}"),
                             export_dir=None)
  metrics_path = os.path.join(tc.workdir, "metrics.jsonl")
  try:
    start = _resume(tc, cfg, trainer, ckpt, dataset, metrics_path)
    distributed.check_same(start, "the step to resume from")
    if start < tc.steps:
      if _loop(tc, cfg, (dataset, held_out), trainer, ckpt, start) < tc.steps:
        logging.info("Stopped (stop_after=%d); the same command continues.", tc.stop_after)
      else:
        _export(tc, cfg, trainer)
    else:
      logging.info("The checkpoint in %s is at step %d: training is complete "
                   "(steps=%d). Use a new --config.workdir to train again.",
                   tc.workdir, start, tc.steps)
  except BaseException:
    _close_quietly(ckpt, trainer)
    raise
  try:
    if ckpt is not None:
      ckpt.close()
  finally:
    trainer.close()  # raises what the last updates met, if anything
  records = metrics_lib.read_metrics(metrics_path)
  metrics_lib.plot_loss(records, os.path.join(tc.workdir, "loss.png"),
                        title=f"{tc.model if isinstance(tc.model, str) else 'custom'} "
                              f"({tc.trainer})")
  logging.info("Wrote %s and loss.png.", metrics_path)
  return records


def _export(tc: TrainConfig, cfg: LlamaConfig, trainer) -> None:
  """Writes the trained model (--export_dir, adapters merged) and the adapters alone
  (--export_adapter_dir, PEFT's format)."""
  if tc.export_dir:
    hf.export(trainer, cfg, tc.export_dir, tc.hf_model_dir, merge_lora=True)
  if tc.export_adapter_dir:
    hf.save_adapter(trainer, cfg, tc.export_adapter_dir, base_model=tc.hf_model_dir)


def _close_quietly(ckpt, trainer) -> None:
  """Closes both while an exception is on its way out: what closing meets is logged,
  not raised over it."""
  for thing in (ckpt, trainer):
    if thing is not None and hasattr(thing, "close"):
      try:
        thing.close()
      except Exception as e:  # pylint: disable=broad-except
        logging.error("Closing %s also failed: %s: %s", type(thing).__name__,
                      type(e).__name__, e)


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


def _loop(tc: TrainConfig, cfg: LlamaConfig, data, trainer: Trainer, ckpt, start: int) -> int:
  """Trains from step `start` to the last step or stop_after; returns the last."""
  dataset, held_out = data
  flops_per_token = metrics_lib.model_flops_per_token(cfg, tc.seq_len)
  settings, lr = checkpoint_settings(tc, cfg), lr_schedule(tc)
  bar = progress.progress_bar(tc.steps, start) if tc.progress else None
  stop = min(tc.steps, start + (tc.stop_after or tc.steps))
  # LoRA dropout's masks: step s from fold_in(key, s), so a resumed run draws the same.
  dropout = jax.random.fold_in(jax.random.key(tc.seed), 0xD50) if (
      cfg.lora is not None and cfg.lora.dropout) else None
  with metrics_lib.MetricsWriter(tc.workdir, append=True,
                                 tensorboard_dir=tc.tensorboard_dir) as writer, \
      progress.logs_around(bar):
    shown: dict[str, str] = {}
    # A logged step's record waits for the next step: its grad_norm (the step's last
    # updates) is known by then without a wait, so logging keeps the overlap.
    pending: list = []

    def flush():
      for record, norm in pending:
        record["grad_norm"] = float(norm)
        writer.write(record)
        logging.info("step %d  loss %.4f  grad_norm %.3g  lr %.3g  %.0f tok/s",
                     record["step"], record["loss"], record["grad_norm"], record["lr"],
                     record["tokens_per_s"])
      pending.clear()

    for step in range(start + 1, stop + 1):
      batch = dataset.next_batch()
      t0 = time.perf_counter()
      m = trainer.step(batch, None if dropout is None else jax.random.fold_in(dropout, step))
      dt = time.perf_counter() - t0
      flush()
      shown["loss"] = f"{m['loss']:.3f}"
      if step == 1 or step % tc.log_every == 0 or step == stop:
        record = {"step": step, "loss": m["loss"], "lr": float(lr(step - 1)),
                  "step_time_s": dt, "tokens_per_s": m["tokens"] / dt,
                  "model_tflops_per_s": flops_per_token * m["tokens"] / dt / 1e12,
                  "skipped_steps": trainer.stats()["skipped_steps"]}
        if dataset.non_padding is not None:
          record["data_non_padding"] = dataset.non_padding
        pending.append((record, m["grad_norm"]))
      if held_out is not None and (step % tc.eval_every == 0 or step == tc.steps):
        flush()  # the pass waits for the last updates anyway
        record = {"step": step, **evaluate(trainer, held_out, tc.eval_batches)}
        writer.write(record)
        shown["eval"] = f"{record['eval_loss']:.3f}"
        logging.info("step %d  eval loss %.4f  perplexity %.2f  (%d tokens)", step,
                     record["eval_loss"], record["eval_perplexity"], record["eval_tokens"])
      if bar is not None:
        bar.update(1)
        bar.set_postfix(shown)
      if ckpt is not None and (step % tc.save_every == 0 or step == stop):
        flush()  # the snapshot waits for the last updates anyway
        ckpt.save(trainer, {**settings,
                            "data_position": dataclasses.asdict(dataset.position)})
    flush()
    trainer.wait()  # the last step's last updates, and anything they found
  if bar is not None:
    bar.close()
  return stop
