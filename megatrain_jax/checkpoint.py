"""Checkpoints of the host-resident training state, written with Orbax while training goes on.

A checkpoint is a directory `<dir>/step_<N>/` holding one Orbax PyTree
checkpoint per part of the state (each unit's fp32 master and optimizer state;
the whole-tree optimizer state where there is one) and `meta.json` (step, data
position, the run's settings, the layout and a CRC-32 of every array).

- Layer by layer from host memory: the writer thread reads a `Snapshot` one
  unit at a time and never stages anything on the accelerator.
- Asynchronous: `save` returns at once; training goes on while the writer works.
  The trainer's `Snapshot` (`engine/host/state.py`) keeps the saved state that of the
  save's step: an update copies a part the writer has not read yet, at most one
  ahead of the writer, then waits for it. The writer reads the parts in the order
  the updates change them, and closes the snapshot when it ends, failed or not.
- Atomic: parts are written under `step_<N>.partial/`, which is renamed to
  `step_<N>/` once `meta.json` is on disk. A directory without the final name
  is not a checkpoint; it is removed, with a warning, the next time a manager
  opens the directory.
- The last `keep` complete checkpoints are kept.
- Frozen parameters (`trainable=`: a LoRA base) are not written, only a CRC-32 of
  each unit's ("base_checksums"): the run rebuilds them from its Hugging Face
  checkpoint or seed, and a resume whose base differs is refused, naming the units.

In a run of several processes every process holds the same state: process 0
writes the checkpoint alone (Orbax restricted to it, so no barrier waits on the
others, and nothing is written twice) and every process reads it back. The
directory must be one that every process sees (a shared filesystem across hosts).

`restore_latest` tries the newest complete checkpoint first; one that cannot be
read back exactly (a missing or damaged file, a checksum mismatch) is skipped,
with a warning, in favour of the previous one. One written by a run with
other settings is refused with the differing fields named.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import zlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from megatrain_jax.engine.host.state import Snapshot, TrainerState

FORMAT_VERSION = 1
FROZEN = "frozen"  # a part's frozen values: referred to by checksum, not written
# Seconds the writer sleeps before each part: a fault-injection hook, so tests can
# kill a process while it is saving. Leave unset.
WRITE_DELAY_ENV = "MEGATRAIN_CKPT_WRITE_DELAY_S"
_STEP_RE = re.compile(r"^step_(\d{8})$")


class _QuietOrbax:
  """Drops Orbax's INFO lines (several per array written); its warnings stay."""

  def filter(self, record) -> bool:
    return record.levelno >= 30 or "orbax" not in record.pathname


_QUIET = _QuietOrbax()


class CheckpointError(RuntimeError):
  """A checkpoint could not be written or read back."""


def checksum(arr: np.ndarray) -> int:
  """CRC-32 of an array's bytes.

  Args:
    arr: the array.

  Returns:
    The CRC-32 of its bytes in C order.
  """
  return zlib.crc32(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def _checkpointer() -> ocp.Checkpointer:
  """Orbax for this process alone: in a run of several processes, no barrier of a
  save (process 0) or a read (every process) waits on the others."""
  if jax.process_count() == 1:
    return ocp.PyTreeCheckpointer()
  alone = ocp.options.MultiprocessingOptions(primary_host=jax.process_index(),
                                             active_processes={jax.process_index()})
  return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(multiprocessing_options=alone),
                          multiprocessing_options=alone)


def _fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _diff(section: str, saved: dict, current: dict) -> list[str]:
  keys = sorted(set(saved) | set(current))
  return [f"{section}.{k}: checkpoint {saved.get(k, '(absent)')!r}, this run "
          f"{current.get(k, '(absent)')!r}" for k in keys if saved.get(k) != current.get(k)]


def _written_layout(trainer: TrainerState) -> dict[str, dict[str, list]]:
  """What a checkpoint of `trainer` holds, as meta.json records it: its state layout
  without the frozen values."""
  return {k: {a: [list(s), d] for a, (s, d) in v.items() if a != FROZEN}
          for k, v in trainer.state_layout().items()}


def _base_checksums(trainer: TrainerState) -> dict[str, int]:
  """The trainer's CRC-32 of each part's frozen values ({} without any)."""
  return dict(getattr(trainer, "frozen_checksums", None) or {})


def _check_base(path: str, want: dict[str, int], trainer: TrainerState) -> None:
  """Refuses a checkpoint whose frozen base is not the trainer's."""
  have = _base_checksums(trainer)
  differ = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
  if differ:
    raise ValueError(
        f"The checkpoint {path} was trained on a base whose frozen values differ from "
        f"this run's in {differ[:4]}{'...' if len(differ) > 4 else ''}: the base "
        "checkpoint (--hf_model_dir) or the seed changed since. Resume with the base "
        "it was trained on, or use a new --workdir.")


def _normalise(x):
  """What `x` reads back as from JSON (tuples become lists)."""
  return json.loads(json.dumps(x))


class CheckpointManager:
  """Saves and restores a trainer's host state under `directory`.

  The trainer provides `snapshot()`, `state_layout()`, `restore(read, step)` and
  `step_count` (both `StreamingTrainer` and `ResidentTrainer` do).
  """

  def __init__(self, directory: str, keep: int = 2):
    if keep < 1:
      raise ValueError(f"keep must be at least 1, got {keep}.")
    self.directory = os.path.abspath(directory)  # Orbax takes absolute paths only
    self.keep = keep
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self.writes = jax.process_index() == 0  # the others' state is the same
    if _QUIET not in logging.get_absl_logger().filters:
      logging.get_absl_logger().addFilter(_QUIET)
    os.makedirs(directory, exist_ok=True)
    for name in sorted(os.listdir(directory)) if self.writes else ():
      if name.startswith("step_") and not _STEP_RE.match(name):
        logging.warning("Removing %s: an incomplete checkpoint (a save was interrupted).",
                        os.path.join(directory, name))
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)

  def steps(self) -> list[int]:
    """Steps of the complete checkpoints, oldest first.

    Returns:
      The step numbers of the `step_<N>` directories.
    """
    out = []
    for name in os.listdir(self.directory):
      m = _STEP_RE.match(name)
      if m and os.path.isdir(os.path.join(self.directory, name)):
        out.append(int(m.group(1)))
    return sorted(out)

  def path(self, step: int) -> str:
    """Where the checkpoint of a step lives.

    Args:
      step: the step.

    Returns:
      `<directory>/step_<N>`, N zero-padded to 8 digits.
    """
    return os.path.join(self.directory, f"step_{step:08d}")

  # -- saving ---------------------------------------------------------------

  def save(self, trainer: TrainerState, meta: dict[str, Any]) -> None:
    """Starts writing the trainer's state at its current step; returns at once.

    `meta` (JSON-serialisable: settings, data position) is stored beside it and
    compared on restore. A save waits for the previous one and raises its error.
    In a run of several processes, only process 0 writes; the others return.

    Args:
      trainer: the trainer to save.
      meta: settings and data position to store with the state.

    Raises:
      CheckpointError: the previous save failed.
    """
    self.wait()
    if not self.writes:
      return
    step = trainer.step_count
    meta = {"format": FORMAT_VERSION, "step": step, "processes": jax.process_count(),
            **_normalise(meta), "layout": _written_layout(trainer)}
    snap = trainer.snapshot()  # from here on, the updates keep it for the writer
    try:
      self._thread = threading.Thread(target=self._write_guarded,
                                      args=(step, snap, meta,
                                            lambda: _base_checksums(trainer)),
                                      name="megatrain-checkpoint", daemon=True)
      self._thread.start()
    except BaseException:
      snap.close()
      self._thread = None
      raise

  def _write_guarded(self, step, snap, meta, base) -> None:
    try:
      base = base()  # the frozen values' checksums (computed once per trainer)
      if base:
        meta["base_checksums"] = base
      self._write(step, snap, meta)
    except BaseException as e:  # pylint: disable=broad-except
      self._error = e
    finally:
      snap.close()  # releases its copies and any update waiting on it

  def _write(self, step: int, snap: Snapshot, meta: dict) -> None:
    t0 = time.perf_counter()
    final, tmp = self.path(step), self.path(step) + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    delay = float(os.environ.get(WRITE_DELAY_ENV, "0") or 0)
    checkpointer = _checkpointer()
    sums, nbytes = {}, 0
    for key in snap.keys:
      if delay:
        time.sleep(delay)
      arrays = snap.take(key)
      arrays.pop(FROZEN, None)  # referred to by `base_checksums`
      sums[key] = {a: checksum(x) for a, x in arrays.items()}
      nbytes += sum(x.nbytes for x in arrays.values())
      # Orbax writes no empty array (a frozen unit's master): the layout says its shape.
      arrays = {a: x for a, x in arrays.items() if x.size}
      if arrays:
        checkpointer.save(os.path.join(tmp, key), arrays)
      del arrays
    meta["checksums"] = sums
    with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
      json.dump(meta, f, indent=1, sort_keys=True)
      f.flush()
      os.fsync(f.fileno())
    _fsync_dir(tmp)
    if os.path.exists(final):
      shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(self.directory)
    logging.info("Saved checkpoint %s (%.1f MB in %.1f s).", final, nbytes / 1e6,
                 time.perf_counter() - t0)
    for old in self.steps()[:-self.keep]:
      shutil.rmtree(self.path(old), ignore_errors=True)

  def wait(self) -> None:
    """Waits for the save in progress; raises CheckpointError if it failed.

    Raises:
      CheckpointError: the last save failed (raised once).
    """
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    if self._error is not None:
      err, self._error = self._error, None
      raise CheckpointError(f"Writing a checkpoint in {self.directory} failed: "
                            f"{type(err).__name__}: {err}") from err

  def close(self) -> None:
    """Waits for the save in progress, as `wait`.

    Raises:
      CheckpointError: the last save failed.
    """
    self.wait()

  # -- restoring ------------------------------------------------------------

  def restore_latest(self, trainer: TrainerState, expect: dict[str, dict[str, Any]]
                     ) -> dict | None:
    """Restores the newest readable checkpoint into `trainer`; returns its meta.

    `expect` holds sections of settings (e.g. {"model": ..., "run": ...}) that
    must equal the checkpoint's. Returns None when there is no checkpoint.

    Args:
      trainer: the trainer to restore into.
      expect: section name -> the settings this run has.

    Returns:
      The restored checkpoint's meta, or None.

    Raises:
      ValueError: the newest checkpoint with a readable meta.json was written with
        other settings or holds a state laid out differently.
      CheckpointError: checkpoints exist but none can be read back; the trainer's
        state is then undefined.
    """
    steps = self.steps()
    if not steps:
      return None
    self.wait()  # a save in progress finishes with the state it began with
    layout = _written_layout(trainer)
    expect = _normalise(expect)
    failures = []
    for step in reversed(steps):
      path = self.path(step)
      try:
        with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
          meta = json.load(f)
        if meta.get("format") != FORMAT_VERSION or meta.get("step") != step:
          raise CheckpointError(f"meta.json has format {meta.get('format')} and step "
                                f"{meta.get('step')}")
      except (OSError, ValueError, CheckpointError) as e:
        failures.append(f"{path}: {e}")
        logging.warning("Skipping checkpoint %s: its meta.json cannot be read (%s).", path, e)
        continue
      self._check_matches(path, meta, expect, layout)
      if meta.get("base_checksums"):
        _check_base(path, meta["base_checksums"], trainer)
      try:
        trainer.restore(lambda key: self._read(path, key, meta), step)
      except Exception as e:  # pylint: disable=broad-except
        failures.append(f"{path}: {e}")
        logging.warning("Skipping checkpoint %s: it cannot be read back exactly (%s: %s); "
                        "trying the previous one.", path, type(e).__name__, e)
        continue
      logging.info("Restored checkpoint %s (step %d).", path, step)
      return meta
    raise CheckpointError(
        f"No checkpoint in {self.directory} could be read back: " + "; ".join(failures)
        + ". The trainer's state is now undefined. Move the directory away to start "
        "afresh.")

  def _check_matches(self, path: str, meta: dict, expect: dict, layout: dict) -> None:
    diffs = []
    for section, current in expect.items():
      diffs += _diff(section, meta.get(section, {}), current)
    if diffs:
      raise ValueError(
          f"The checkpoint {path} was written by a run with other settings: "
          + "; ".join(diffs) + ". Rerun with the settings of the run that wrote it, or "
          "use a new --workdir.")
    written = {k: {a: v for a, v in part.items() if a != FROZEN}  # older: frozen kept
               for k, part in meta["layout"].items()}
    if written != layout:
      parts = sorted(set(written) ^ set(layout)) or [
          k for k in layout if written[k] != layout[k]]
      raise ValueError(
          f"The checkpoint {path} holds a state laid out differently from this "
          f"trainer's (parts {parts[:4]}{'...' if len(parts) > 4 else ''} differ): was it "
          "written with another optimizer or engine? Rerun with the settings of the run "
          "that wrote it, or use a new --workdir.")

  def _read(self, path: str, key: str, meta: dict) -> dict[str, np.ndarray]:
    want = meta["layout"][key]
    empty = {a: np.zeros(shape, dtype) for a, (shape, dtype) in want.items()
             if not np.prod(shape)}
    arrays = {**(_checkpointer().restore(os.path.join(path, key))
                 if len(empty) < len(want) else {}), **empty}
    if set(arrays) != set(want):
      raise CheckpointError(f"part {key} holds arrays {sorted(arrays)}, expected "
                            f"{sorted(want)}")
    out = {}
    for a, (shape, dtype) in want.items():
      x = np.asarray(arrays[a])
      if list(x.shape) != shape or str(x.dtype) != dtype:
        raise CheckpointError(f"{key}/{a} is {x.dtype}{list(x.shape)}, expected "
                              f"{dtype}{shape}")
      if checksum(x) != meta["checksums"][key][a]:
        raise CheckpointError(f"{key}/{a} does not match its checksum")
      out[a] = x
    return out
