"""The process state of xla_fp4, in one object: what lives as long as the process (or until a test replaces it).

- kernel registration: the XLA platforms whose FFI targets are registered, those refused and why
  (kernels/registry.py), and the targets whose partitioners XLA has (sharding/register.py);
- the lowered twins: a twin's StableHLO text per signature (lowering one costs far more than parsing it back, so each signature is lowered once per process: passes/rewrite/kernel_sets.py `Twins`);
- the dump counter (passes/pipeline.py `dump`);
- telemetry (telemetry.py): the probed GEMMs' names and where their records go, the writer thread;
- what has been told the user, each thing once per process (`first_time`): a platform whose kernels cannot register
  (kernels/registry.py); that the pass failed, that it is active, that a user's pattern matched nothing (hook.py; the
  hook's installation itself, a patch of JAX, stays with the hook).

Code reads `current()`; a test makes its own (`with state.use(State()) as s:`, or a copy with some fields
replaced) instead of patching modules.
"""

import contextlib
import dataclasses
import itertools
import threading
from typing import Any


@dataclasses.dataclass
class Telemetry:
  sites: dict = dataclasses.field(default_factory=dict)  # (module key, site index) -> telemetry.Site
  modules: dict = dataclasses.field(default_factory=dict)  # a program's identity -> its module key (register_module)
  writer: Any = None  # the thread that flushes the sinks
  lock: Any = dataclasses.field(default_factory=threading.Lock, repr=False)  # one flush at a time


@dataclasses.dataclass
class State:
  registered: set = dataclasses.field(default_factory=set)  # XLA platform names: "cpu", "CUDA"
  refused: dict = dataclasses.field(default_factory=dict)  # XLA platform name -> why its targets were not registered
  partitioners: list = dataclasses.field(default_factory=list)  # targets whose partitioner XLA has (sharding/register.py)
  lowered_twins: dict = dataclasses.field(default_factory=dict)  # twin signature -> its StableHLO text
  dumps: Any = dataclasses.field(default_factory=itertools.count)  # numbers the dump files of a process
  said: set = dataclasses.field(default_factory=set)  # what has been told the user (first_time's keys)
  telemetry: Telemetry = dataclasses.field(default_factory=Telemetry)
  lock: Any = dataclasses.field(default_factory=threading.RLock, repr=False)

  def first_time(self, key):
    """Whether `key` has not been said yet in this process (and from now on, it has)."""
    with self.lock:
      if key in self.said:
        return False
      self.said.add(key)
      return True


_current = State()


def current() -> State:
  return _current


@contextlib.contextmanager
def use(state: State):
  """Make `state` the current one inside the block (tests: a fresh registration, cache or hook state)."""
  global _current
  previous, _current = _current, state
  try:
    yield state
  finally:
    _current = previous
