"""A trainer's life: idle waits, late failures, close, a dropped trainer, revival by restore."""

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import jax
import numpy as np
import optax
import pytest

import megatrain_jax as mt
from megatrain_jax.engine.device import transport as transport_lib

from conftest import TINY, random_batch


def _engine_threads():
  return [t for t in threading.enumerate() if t.name.startswith("megatrain-") and t.is_alive()]


def _engine(opt=None, **kw):
  return mt.StreamingTrainer.from_config(TINY, opt or mt.optim.adamw(1e-2),
                                         mt.EngineConfig(**kw), jax.random.key(0))


class _SlowFailingD2H(transport_lib.DeviceTransport):
  """Each gradient's trip takes `delay_s`; the `fail_at`-th one raises."""

  def __init__(self, fail_at, delay_s=0.3):
    super().__init__()
    self.fail_at, self.delay_s, self.calls = fail_at, delay_s, 0

  def d2h(self, device_array):
    self.calls += 1
    time.sleep(self.delay_s)
    if self.calls == self.fail_at:
      raise OSError("injected late d2h fault")
    return super().d2h(device_array)


def test_idle_trainers_do_not_time_out_and_use_under_one_percent_of_a_core():
  # Between steps every engine thread sleeps until it is notified: the prefetcher
  # (its next units fetched), the gradient and optimizer threads, the activations'
  # thread. Nothing polls, so an idle trainer costs no CPU; and an idle wait longer
  # than `timeout_s` is no failure, for updates made per unit as they arrive or
  # (a whole-tree transform) after the step's sweep.
  whole_tree = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
  with _engine(timeout_s=2.0, activations="host") as eng, \
       _engine(whole_tree, timeout_s=2.0) as deferred:
    for s in range(2):
      for e in (eng, deferred):
        e.step(random_batch(TINY, seed=s))
    eng.wait()
    deferred.wait()
    time.sleep(0.5)  # the last updates' fetches ahead land
    t0, c0 = time.monotonic(), time.process_time()
    time.sleep(5.0)
    used = (time.process_time() - c0) / (time.monotonic() - t0)
    for e in (eng, deferred):
      assert np.isfinite(e.step(random_batch(TINY, seed=2))["loss"])
  assert used < 0.01, f"{100 * used:.2f}% of a core while idle"


def test_a_failure_after_the_step_returned_is_raised_by_close_and_after():
  # Gradients take 0.3 s each to come back: the step returns after the head's, and
  # the last one (layer 0's) fails while nobody waits on the engine.
  n_units = TINY.n_layers + 2
  eng = _engine(transport=_SlowFailingD2H(fail_at=n_units))
  eng.step(random_batch(TINY))
  with pytest.raises(OSError, match="injected late d2h fault"):
    eng.close()
  assert not _engine_threads()
  for call in (eng.params, eng.wait, lambda: eng.unit_params(0)):
    with pytest.raises(RuntimeError, match="injected late d2h fault"):
      call()
  eng.close()  # reported once; closing again is quiet


def test_a_failure_after_the_step_returned_is_raised_by_exit():
  n_units = TINY.n_layers + 2
  with pytest.raises(OSError, match="injected late d2h fault"):
    with _engine(transport=_SlowFailingD2H(fail_at=n_units)) as eng:
      eng.step(random_batch(TINY))
  assert not _engine_threads()


def test_exit_does_not_hide_the_exception_in_the_with_block():
  n_units = TINY.n_layers + 2
  with pytest.raises(KeyError, match="the user's own error"):
    with _engine(transport=_SlowFailingD2H(fail_at=n_units)) as eng:
      eng.step(random_batch(TINY))
      raise KeyError("the user's own error")


def test_a_dropped_trainer_is_freed_and_its_threads_stop():
  before = len(_engine_threads())
  eng = _engine()
  eng.step(random_batch(TINY))
  ref = weakref.ref(eng)
  del eng
  gc.collect()
  assert ref() is None
  deadline = time.monotonic() + 10
  while len(_engine_threads()) > before and time.monotonic() < deadline:
    time.sleep(0.05)
  assert len(_engine_threads()) == before


def test_a_dropped_trainer_returns_its_host_memory():
  # A model whose host state (fp32 master + Adam moments) is ~150 MB, dropped twice
  # without close(): the process' resident memory must come back each time.
  code = textwrap.dedent("""
      import gc, jax, megatrain_jax as mt
      from conftest import random_batch
      cfg = mt.LlamaConfig(vocab_size=256, d_model=512, n_layers=4, n_heads=8,
                           n_kv_heads=4, d_ff=1536, max_seq_len=32)
      def rss():
        with open("/proc/self/statm") as f:
          return int(f.read().split()[1]) * 4096
      def build_and_drop():
        eng = mt.StreamingTrainer.from_config(cfg, mt.optim.adamw(1e-3),
                                              mt.EngineConfig(), jax.random.key(0))
        eng.step(random_batch(cfg, 1, 8))
        eng.wait()
        return rss(), eng.stats()["param_count"]
      sizes = []
      for _ in range(3):
        held, n = build_and_drop()  # the trainer is dropped as the function returns
        gc.collect()
        sizes.append((held, rss()))
      print("RESULT", repr((n, sizes)))
  """)
  env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  line = [l for l in out.stdout.splitlines() if l.startswith("RESULT")][-1]
  n, sizes = eval(line[len("RESULT "):])  # pylint: disable=eval-used
  state = 12 * n
  for held, after in sizes:
    assert held - after > 0.8 * state, (n, sizes)  # the trainer's state went back
  assert sizes[-1][1] - sizes[0][1] < 0.5 * state, (n, sizes)  # nothing piles up


def test_close_frees_the_buffers_fetched_ahead():
  eng = _engine()
  eng.step(random_batch(TINY))
  eng.wait()
  assert eng.stats()["device_bytes"] > 0  # the next step's first units, fetched ahead
  eng.close()
  assert eng.stats()["device_bytes"] == 0


def test_restore_revives_a_trainer_invalid_after_a_failure():
  eng = _engine(transport=_SlowFailingD2H(fail_at=3, delay_s=0.0))
  snap = eng.snapshot()
  saved = {k: snap.take(k) for k in snap.keys}
  with pytest.raises(OSError, match="injected late d2h fault"):
    eng.step(random_batch(TINY))
    eng.wait()
  with pytest.raises(RuntimeError, match="invalid"):
    eng.step(random_batch(TINY))
  eng.restore(lambda key: saved[key], 0)
  with _engine() as fresh:
    want = fresh.step(random_batch(TINY))["loss"]
  assert eng.step(random_batch(TINY))["loss"] == want
  eng.close()


def test_restore_on_a_closed_trainer_is_refused():
  eng = _engine()
  snap = eng.snapshot()
  saved = {k: snap.take(k) for k in snap.keys}
  eng.close()
  with pytest.raises(RuntimeError, match="closed"):
    eng.restore(lambda key: saved[key], 0)


def test_a_failed_trainer_frees_its_device_buffers_and_can_be_dropped():
  eng = _engine(transport=_SlowFailingD2H(fail_at=3, delay_s=0.0))
  with pytest.raises(OSError, match="injected late d2h fault"):
    eng.step(random_batch(TINY))
    eng.wait()
  assert eng.stats()["device_bytes"] == 0  # nothing of the failed step is counted
  ref = weakref.ref(eng)
  del eng
  gc.collect()
  assert ref() is None  # the stored error keeps no frame of it alive


def test_the_thread_never_waits_for_an_update_and_a_cancel_is_prompt():
  # The prefetch thread fetches only units `ready` found updated, and its fetch is
  # never asked to wait for an update (a refused step can take one back after the
  # check: its cancel then drops what was fetched instead of waiting out timeout_s).
  import threading
  import time
  from megatrain_jax.engine.device.ledger import Ledger
  from megatrain_jax.engine.device.prefetch import Prefetcher
  asked, taken_back = [], threading.Event()

  def fetch(u, tag, deadline):
    asked.append(deadline)
    taken_back.set()
    return jax.numpy.zeros(4)

  ready = lambda u, tag: not taken_back.is_set()
  pf = Prefetcher(fetch, depth=2, hold=1, ledger=Ledger(), timeout_s=60.0, ready=ready)
  pf.start([0, 1, 2], tag=1)
  assert taken_back.wait(10)
  t0 = time.monotonic()
  pf.cancel()
  assert time.monotonic() - t0 < 5
  assert asked == [None]  # one fetch, then nothing ready: and it was never told to wait
  pf.close()
