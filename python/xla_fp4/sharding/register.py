"""Installing the partitioners with XLA: every target's custom-call partitioner, from its record (kernels/targets.py)
through the module that partitions its kind. Block-local targets: partition.py; packed ones: packed.py; side-effecting
ones (telemetry): device_rows.py. Which targets XLA has is process state (state.py `partitioners`)."""

import functools

from jax._src.lib import xla_client as xc

from xla_fp4 import state
from xla_fp4.kernels import targets
from xla_fp4.sharding import device_rows
from xla_fp4.sharding import packed
from xla_fp4.sharding import partition


def register():
  """Install the partitioners with XLA, for the built-in backends now and for plugin backends (GPU) as they load."""
  current = state.current()
  with current.lock:
    if current.partitioners:
      return
    for target in targets.ALL:
      if target.block_local is not None:
        _install(current, target.name, prop_user_sharding=functools.partial(partition.propagate_user_sharding, target.name),
                 partition=functools.partial(partition.partition, target.name),
                 infer_sharding_from_operands=functools.partial(partition.infer_from_operands, target.name))
      elif target.side_effect:
        # Side-effecting calls must be told apart from ones XLA may replicate: each device runs these on its own.
        _install(current, target.name, prop_user_sharding=lambda *a: xc.HloSharding.replicate(),
                 partition=functools.partial(device_rows.replicated, target.name),
                 infer_sharding_from_operands=lambda *a: xc.HloSharding.replicate(),
                 can_side_effecting_have_replicated_sharding=True)
      elif target.packed is not None:
        _install(current, target.name, **packed.callbacks(target))


def _install(current, target, **callbacks):
  """Register `target`'s partitioner with XLA, now and for plugin backends (GPU) as they load."""
  from jax._src import xla_bridge
  xc.register_custom_call_partitioner(target, **callbacks)
  xla_bridge.register_plugin_callbacks(functools.partial(xc.register_custom_call_partitioner, target, **callbacks))
  current.partitioners.append(target)
