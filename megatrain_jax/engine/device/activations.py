"""Activation checkpoints in host memory (`EngineConfig.activations="host"`).

During the forward each checkpointed block input is handed to `HostActivations`,
whose transfer thread copies it to host memory (`Transport.offload`) while the
next layers compute; its device buffer is counted in the ledger until the copy is
done, and at most one copy is outstanding, so the device holds a fixed number of
checkpoints whatever the depth (`plan.simulate` counts them). The
backward asks for each group's input one group ahead (`prefetch`), and the same
thread brings it back (`Transport.reload`) while the group before computes.

The last groups' inputs are needed first in the backward and never leave the
device (`Schedule.device_checkpoints`; the step hands over only the others). One
daemon thread moves both directions in the order asked, which is the order the
step needs them. A failure on the thread is raised in the caller by the
next `put`, `flush` or `take`; a caller waits at most `timeout_s`. The step calls
`flush` before its first gradient leaves, so a failed copy out is raised before
anything is updated. A transfer that never ends cannot keep the process from
exiting, and once closed the thread no longer touches the ledger.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Any, Callable

import jax

from megatrain_jax.engine.device.ledger import Ledger
from megatrain_jax.engine.workers import WorkerError
from megatrain_jax.engine.device.transport import Transport


def tree_bytes(tree) -> int:
  """Bytes of every array in a checkpoint (a block input, or one with its residuals).

  Args:
    tree: an array or a tree of arrays.

  Returns:
    Their total size in bytes.
  """
  return sum(a.nbytes for a in jax.tree.leaves(tree))


class HostActivations:
  """Block inputs of one micro-batch, waiting in host memory for the backward."""

  def __init__(self, transport: Transport, ledger: Ledger, timeout_s: float):
    """Starts the transfer thread.

    Args:
      transport: moves the bytes (`offload` and `reload`).
      ledger: counts the device bytes of checkpoints moving or on the device.
      timeout_s: the longest a caller waits for a transfer.
    """
    self._tp, self._ledger, self._timeout = transport, ledger, timeout_s
    self._jobs: queue.Queue = queue.Queue()
    self._closed = False
    self._out: dict[Any, concurrent.futures.Future] = {}
    self._in: dict[Any, concurrent.futures.Future] = {}
    self.bytes_moved = {"d2h": 0, "h2d": 0}
    self._lock = threading.Lock()
    self._held: dict[Any, int] = {}  # checkpoints in host memory, by key
    self.host_peak_bytes = 0
    self._thread = threading.Thread(target=self._run, name="megatrain-activations",
                                    daemon=True)
    self._thread.start()

  def _run(self) -> None:
    while True:
      job = self._jobs.get()
      if job is None:
        return
      future, fn, args = job
      if future.set_running_or_notify_cancel():
        try:
          future.set_result(fn(*args))
        except BaseException as e:  # pylint: disable=broad-except
          future.set_exception(e)
      # A checkpoint sent must not stay alive on the device through this thread's
      # next wait: drop the job (its arguments hold the device array).
      del job, future, fn, args

  def _submit(self, fn: Callable, *args) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._jobs.put((future, fn, args))
    return future

  def _count(self, key, nbytes: int | None) -> None:
    """The ledger's entry for a checkpoint on the device (None: not there)."""
    if self._closed:  # a transfer that outlived the runtime changes nothing
      return
    if nbytes is None:
      self._ledger.remove(key)
    else:
      self._ledger.add(key, nbytes)

  def _hold(self, key, nbytes: int | None) -> None:
    with self._lock:
      if nbytes is None:
        self._held.pop(key, None)
      else:
        self._held[key] = nbytes
      self.host_peak_bytes = max(self.host_peak_bytes, sum(self._held.values()))

  def _send(self, key, x) -> Any:
    try:
      host = self._tp.offload(x)
      self.bytes_moved["d2h"] += tree_bytes(x)
      self._hold(key, tree_bytes(host))
      return host
    finally:
      self._count(key, None)  # the device buffer is free (or lost)

  def _bring(self, key, out: concurrent.futures.Future) -> Any:
    host = out.result()
    self._count(key, tree_bytes(host))
    x = self._tp.reload(host)
    self.bytes_moved["h2d"] += tree_bytes(x)
    self._hold(key, None)
    return x

  def _wait(self, future: concurrent.futures.Future, what: str):
    try:
      return future.result(timeout=self._timeout)
    except concurrent.futures.TimeoutError:
      raise TimeoutError(f"Moving {what} between device and host took more than "
                         f"{self._timeout:g} s (EngineConfig.timeout_s).") from None
    except concurrent.futures.CancelledError:
      raise WorkerError(f"The transfer of {what} was cancelled (the engine is "
                        "shutting down).") from None

  def put(self, key, x) -> None:
    """Sends a checkpoint to host memory, once the one before it has arrived there.
    The caller has counted it in the ledger under `key`; it is freed there once it
    has left the device.

    Args:
      key: its ledger key.
      x: the block input, on the device (or, with recompute "dots" or "none", the
        input with the layer's kept residuals: a tree of device arrays).

    Raises:
      What the earlier transfer met; TimeoutError if it takes over `timeout_s`.
    """
    self.flush()
    self._out[key] = self._submit(self._send, key, x)

  def flush(self) -> None:
    """Waits until every checkpoint sent has arrived in host memory.

    Raises:
      What a transfer met; TimeoutError if one takes over `timeout_s`.
    """
    for k, f in list(self._out.items()):
      self._wait(f, f"the activation checkpoint of layer {k}")

  def prefetch(self, key) -> None:
    """Starts bringing a checkpoint back to the device (after it has left).

    Args:
      key: a key given to `put`.
    """
    if key in self._out and key not in self._in:
      self._in[key] = self._submit(self._bring, key, self._out[key])

  def take(self, key) -> Any:
    """A checkpoint back on the device (fetched now if `prefetch` did not ask).

    Args:
      key: a key given to `put`.

    Returns:
      What `put` was given, on the device; counted in the ledger under `key` until
      the caller removes it.

    Raises:
      What the transfer met; TimeoutError if it takes over `timeout_s`.
    """
    self.prefetch(key)
    x = self._wait(self._in.pop(key), f"the activation checkpoint of layer {key}")
    self._out.pop(key, None)
    return x

  def close(self) -> None:
    """Stops the thread (waiting for it at most `timeout_s`); transfers not started
    are dropped, and the ledger forgets the checkpoints."""
    for key in set(self._out) | set(self._in):
      self._count(key, None)
    self._closed = True
    for f in [*self._out.values(), *self._in.values()]:
      f.cancel()
    self._out.clear()
    self._in.clear()
    self._jobs.put(None)
    self._thread.join(self._timeout)
