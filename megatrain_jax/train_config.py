"""A training run's settings: `TrainConfig`, whose fields an experiment's config file
holds (`experiments/configs/`, `megatrain_jax.configs`)."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from megatrain_jax import data as data_lib
from megatrain_jax import hf
from megatrain_jax.engine import EngineConfig, SimulatedLink
from megatrain_jax.engine.config import config_field as _field
from megatrain_jax.models import lora as lora_lib
from megatrain_jax.models.config import COMPUTE_FIELDS, LlamaConfig, preset

ENGINES = ("streaming", "resident")
DATA_FORMATS = ("text", "jsonl", *data_lib.INSTRUCT_FORMATS)


@dataclasses.dataclass
class TrainConfig:
  """One training run. The defaults are the README's main job (tiny model, stdlib).

  Every field is a field of an experiment's config file (its help below), and so is
  every field of the nested `engine` (see `EngineConfig`): on the command line,
  `--config.steps=50`, `--config.engine.prefetch_depth=3`.
  """

  workdir: str = _field("runs/default", "Output directory: metrics.jsonl, loss.png, "
                        "checkpoints/. Rerunning with the same one resumes.")
  model: Any = _field("tiny", "Model size: one of megatrain_jax.PRESETS (or a LlamaConfig "
                      "from Python).")
  trainer: str = _field("streaming", "The streaming engine, or the resident reference "
                        "(the whole model on the device).", choices=ENGINES)
  steps: int = _field(200, "Training steps.", low=1)
  stop_after: int | None = _field(
      None, "Stop after this many steps of this invocation, with a checkpoint (a cluster "
      "job's time limit); the same command again continues the run.", low=1)
  batch_size: Any = _field(16, "Sequences per step, or 'auto': the largest the planner "
                           "says fits the device.", as_string=True)
  seq_len: int = _field(128, "Tokens per sequence.", low=1)
  lr: float = _field(3e-3, "Peak learning rate (warmup, then cosine decay).")
  warmup_steps: int = _field(20, "Linear warmup steps.", low=0)
  weight_decay: float = _field(0.01, "AdamW weight decay.", low=0)
  data: str = _field(data_lib.STDLIB, "Comma-separated files/directories, or 'stdlib' "
                     "(the Python standard library's source, no download).")
  data_format: str = _field("text", "text: plain files (.jsonl by suffix); jsonl: "
                            "{\"text\"} per line; alpaca; sharegpt.", choices=DATA_FORMATS)
  overlong: str = _field("truncate", "Instruction records longer than seq_len + 1.",
                         choices=data_lib.instruct.OVERLONG)
  pack: bool | None = _field(None, "Pack several documents into each sequence, kept apart "
                             "by segment ids (attention stays within a document, positions "
                             "restart). Default: on for alpaca/sharegpt, off for text.")
  attention_block: int | str | None = _field(
      None, "Attention in blocks of this many tokens (blockwise, or cuDNN's fused kernel "
      "on a GPU in bf16): memory grows with seq_len, not its square; 'dense': the T x T "
      "scores; 'auto': cuDNN's kernel on a GPU, else blockwise from 2048 tokens on. "
      "Default: the model's (auto, unless its config says otherwise).", low=1)
  mlp_chunk: int | None = _field(
      None, "Run each dense layer's feed-forward this many tokens at a time, bounding "
      "its workspace at long seq_len. Default: the model's.", low=1)
  max_data_bytes: int | None = _field(4_000_000, "Stop reading data after this many "
                                      "bytes.", low=1)
  hf_model_dir: str | None = _field(None, "Hugging Face Llama/Qwen2/Mistral checkpoint "
                                    "directory to fine-tune (config, safetensors, tokenizer).")
  export_dir: str | None = _field(None, "Write the trained model here in Hugging Face "
                                  "format (LoRA adapters merged into the weights).")
  lora_rank: int | None = _field(
      None, "Train LoRA adapters of this rank on a frozen base (kept on the host in the "
      "compute dtype: no fp32 master, optimizer state or gradient for it). Default: "
      "train every weight.", low=1)
  lora_alpha: float = _field(32.0, "LoRA's scale numerator: adapters add "
                             "x A B * alpha / rank.", low=0)
  lora_targets: str = _field(",".join(lora_lib.ALL_TARGETS), "Comma-separated projections "
                             f"that get adapters, of {','.join(lora_lib.ALL_TARGETS)}.")
  lora_dropout: float = _field(0.0, "Dropout on the adapters' input during training.", low=0)
  freeze: str | None = _field(
      None, "Freeze the parameters whose path matches this regex (searched in paths "
      "like 'embed/embedding', 'blocks/0/attn/q/kernel', 'head/lm_head/kernel'), e.g. "
      "'^embed/|^blocks/[0-3]/'. With --config.lora_rank, the adapters train except those "
      "it matches.")
  export_adapter_dir: str | None = _field(
      None, "Write the trained LoRA adapters here in PEFT's format (needs --config.lora_rank).")
  eval_every: int = _field(0, "Evaluate the held-out loss every N steps and at the end "
                           "(0: never).", low=0)
  eval_data: str | None = _field(
      None, "Held-out data, in data_format (default: eval_fraction of the training "
      "documents or conversations, split off by document).")
  eval_fraction: float = _field(0.05, "With eval_every and no eval_data: the share of "
                                "the documents held out from training.", low=0)
  eval_batches: int = _field(4, "Batches of the held-out data each evaluation averages "
                             "over (the same ones every time).", low=1)
  tensorboard_dir: str | None = _field(
      None, "Also write the metrics as TensorBoard event files here (needs "
      "tensorboardX: pip install 'megatrain_jax[tensorboard]').")
  seed: int = _field(0, "Seed for init and data order.")
  log_every: int = _field(10, "Log every N steps.", low=1)
  save_every: int = _field(100, "Checkpoint every N steps and at the end (0: never).",
                           low=0)
  keep: int = _field(2, "Complete checkpoints to keep.", low=1)
  host_memory_limit_bytes: int | None = _field(
      None, "Host memory the preflight may plan for (default: what the kernel reports "
      "available).", size=True, low=1)
  simulated_link_gb_per_s: float | None = _field(
      None, "Streaming: move bytes through a simulated link of this bandwidth "
      "(SimulatedLink), to study overlap on a CPU.", low=0)
  progress: bool = _field(True, "Show a progress bar on a terminal.")
  engine: EngineConfig = _field(EngineConfig(), "The streaming engine's settings.")

  # Settings a resumed run must share with the run that wrote the checkpoint.
  RESUME_FIELDS = ("trainer", "steps", "batch_size", "seq_len", "lr", "warmup_steps",
                   "weight_decay", "data", "data_format", "overlong", "max_data_bytes",
                   "seed", "hf_model_dir", "freeze")

  def model_config(self) -> LlamaConfig:
    """The model.

    Returns:
      The checkpoint's config with --config.hf_model_dir, else the preset (or the config),
      with --config.attention_block and --config.mlp_chunk when given.
    """
    if self.hf_model_dir:
      cfg = hf.read_config(self.hf_model_dir)[0]
    else:
      cfg = preset(self.model) if isinstance(self.model, str) else self.model
    return cfg.replace(**self.compute(), lora=self.lora_config())

  def lora_config(self) -> lora_lib.LoraConfig | None:
    """The adapters --config.lora_rank asks for.

    Returns:
      The `LoraConfig`, or None without --config.lora_rank.

    Raises:
      ValueError: a bad target, alpha or dropout, naming the flag.
    """
    if self.lora_rank is None:
      return None
    targets = tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())
    try:
      return lora_lib.LoraConfig(rank=self.lora_rank, alpha=self.lora_alpha,
                                 targets=targets, dropout=self.lora_dropout)
    except ValueError as e:
      raise ValueError(f"--config.lora_*: {e}") from None

  def trainable(self) -> Any:
    """What trains: an NNX filter or a path predicate for `trainable=`.

    Returns:
      None (every parameter) without --config.lora_rank or --config.freeze; else the adapters and/or
      the parameters --config.freeze does not match.
    """
    if self.freeze is None and self.lora_rank is None:
      return None
    pattern = re.compile(self.freeze) if self.freeze else None
    adapters_only = self.lora_rank is not None

    def trains(path: tuple) -> bool:
      if adapters_only and not lora_lib.is_adapter(path):
        return False
      return pattern is None or not pattern.search("/".join(map(str, path)))
    return trains

  def compute(self) -> dict[str, Any]:
    """The model settings given by flags that change how it computes, not what.

    Returns:
      --config.attention_block ("dense" as None) and --config.mlp_chunk, those given.
    """
    out = {k: getattr(self, k) for k in COMPUTE_FIELDS if getattr(self, k) is not None}
    if out.get("attention_block") == "dense":
      out["attention_block"] = None
    return out

  def packs(self) -> bool:
    """Whether the data is packed.

    Returns:
      --config.pack, or when unset whether the data is instruction data.
    """
    return self.data_format in data_lib.INSTRUCT_FORMATS if self.pack is None else self.pack

  def streaming_config(self) -> EngineConfig:
    """The streaming engine's config for this run.

    Returns:
      `engine`, with a `SimulatedLink` when simulated_link_gb_per_s is set.
    """
    if self.simulated_link_gb_per_s:
      return dataclasses.replace(self.engine,
                                 transport=SimulatedLink(self.simulated_link_gb_per_s))
    return self.engine

  def tokenizer(self):
    """The checkpoint's tokenizer.json with --config.hf_model_dir, else the byte tokenizer."""
    if self.hf_model_dir and os.path.exists(os.path.join(self.hf_model_dir, "tokenizer.json")):
      return data_lib.HFTokenizer(self.hf_model_dir)
    return data_lib.ByteTokenizer()

  def validate(self) -> None:
    """Checks the fields against each other and the model.

    Raises:
      ValueError: a field out of range, naming the flag and what to change.
    """
    for f in dataclasses.fields(self):
      value, meta = getattr(self, f.name), f.metadata
      if "choices" in meta and value not in meta["choices"]:
        raise ValueError(f"--config.{f.name}={value!r} is not one of {meta['choices']}.")
      if f.name == "attention_block" and isinstance(value, str):
        if value not in ("auto", "dense"):
          raise ValueError(f"--config.attention_block={value!r}: give a number of tokens, "
                           "'auto' or 'dense'.")
        continue
      if "low" in meta and value is not None and isinstance(value, (int, float)) \
          and value < meta["low"]:
        raise ValueError(f"--config.{f.name} must be >= {meta['low']}, got {value}.")
    if os.path.exists(self.workdir) and not os.path.isdir(self.workdir):
      raise ValueError(f"--config.workdir={self.workdir} is a file; give a directory (it "
                       "is created if missing).")
    cfg = self.model_config()
    if self.hf_model_dir:  # every tensor against config.json, from the file headers
      hf.check_checkpoint(self.hf_model_dir, cfg)
    ec = self.engine
    if self.batch_size == "auto":
      if self.trainer != "streaming":
        raise ValueError("--config.batch_size=auto plans for the streaming engine; give a "
                         "number with --config.trainer=resident.")
    elif isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) \
        or self.batch_size <= 0:
      raise ValueError(f"--config.batch_size must be a positive integer or 'auto', got "
                       f"{self.batch_size!r}.")
    if self.trainer == "resident" and ec.nonfinite != "raise":
      raise ValueError("--config.engine.nonfinite=skip needs --config.trainer=streaming; "
                       "the resident trainer raises on a non-finite step (and changes "
                       "nothing).")
    if self.seq_len > cfg.max_seq_len:
      raise ValueError(f"--config.seq_len={self.seq_len} exceeds the model's max_seq_len="
                       f"{cfg.max_seq_len}; lower --config.seq_len or pick a larger "
                       "--config.model.")
    split = ec.grad_accum * max(ec.data_parallel, 1)
    if self.trainer == "streaming" and self.batch_size != "auto" \
        and self.batch_size % split:
      raise ValueError(f"--config.batch_size={self.batch_size} is not divisible by "
                       f"--config.engine.grad_accum={ec.grad_accum} x "
                       f"--config.engine.data_parallel={max(ec.data_parallel, 1)}: make it a "
                       f"multiple of {split}.")
    if not self.lr > 0:
      raise ValueError(f"--config.lr must be positive, got {self.lr}.")
    if self.freeze is not None:
      try:
        re.compile(self.freeze)
      except re.error as e:
        raise ValueError(f"--config.freeze={self.freeze!r} is not a regular expression: "
                         f"{e}.") from None
    if self.eval_data and not self.eval_every:
      raise ValueError("--config.eval_data is read only with --config.eval_every=N (N > 0).")
    if self.eval_every and not self.eval_data and not 0 < self.eval_fraction < 1:
      raise ValueError(f"--config.eval_fraction must be in (0, 1) to hold out training "
                       f"data, got {self.eval_fraction}; or give --config.eval_data.")
    if self.tensorboard_dir:
      try:
        import tensorboardX  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
      except ImportError:
        raise ValueError("--config.tensorboard_dir needs tensorboardX: pip install "
                         "'megatrain_jax[tensorboard]'.") from None
    if self.export_adapter_dir and self.lora_rank is None:
      raise ValueError("--config.export_adapter_dir writes LoRA adapters: give "
                       "--config.lora_rank too (or --config.export_dir for the whole model).")
