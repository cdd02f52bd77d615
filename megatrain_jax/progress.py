"""A progress bar for the training loop, with log lines kept above it."""

from __future__ import annotations

import contextlib
import logging as std_logging
import sys

from absl import logging


def progress_bar(total: int, start: int):
  """A progress bar, on a terminal only.

  Args:
    total: steps in the run.
    start: steps already done.

  Returns:
    A tqdm bar, or None elsewhere (CI, files), where each logged step is one plain
    log line.
  """
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True,
             disable=None)
  return None if bar.disable else bar


@contextlib.contextmanager
def logs_around(bar):
  """While a bar is shown, log lines go through tqdm, above the bar (not over it).

  Args:
    bar: the bar, or None (nothing changes).

  Yields:
    Nothing; the redirection lasts the `with` block.
  """
  if bar is None:
    yield
    return
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  root, absl_handler = std_logging.getLogger(), logging.get_absl_handler()

  class AboveTheBar(std_logging.Handler):
    def emit(self, record):
      tqdm.write(self.format(record), file=sys.stderr)

  handler = AboveTheBar()
  handler.setFormatter(logging.PythonFormatter())
  had_absl = absl_handler in root.handlers
  root.removeHandler(absl_handler)
  root.addHandler(handler)
  try:
    yield
  finally:
    root.removeHandler(handler)
    if had_absl:
      root.addHandler(absl_handler)
