"""MaxText's trainer with its imports paid once: run by run.py in the MaxText venv, it imports
`maxtext.trainers.pre_train.train` (20-25 s here, longer than a small model's init, compile and steps together), then
runs each requested training in a forked child, exactly as `python -m maxtext.trainers.pre_train.train ...` would.

Protocol (one JSON object per line): run.py writes {"argv", "env", "cwd", "log", "timeout"}, where env holds the
run's own variables (this process started without any of them); this process answers {"returncode"} when the child
has exited (a child past its timeout is killed: -9). The child keeps what MaxText's import put in the environment
(jax's Cloud TPU check sets TPU_SKIP_MDS_QUERY, without which libtpu asks a metadata server for minutes), as a fresh
process would.

Why a fork is the same run as a fresh process: importing MaxText initializes no JAX backend (no device, no compile),
loads no jax_plugins entry point (xla_fp4's is loaded with the backends, in the child) and reads neither XLA_FLAGS nor
XLA_FP4*: the child sets its own environment before any of them is read. Each child starts from the same imported,
untouched state; nothing a child does reaches the next.
"""

import json
import os
import signal
import sys
import time

# The replies' channel is this process's stdout as it started; whatever MaxText's import prints goes to stderr.
REPLIES = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

from absl import app  # pylint: disable=wrong-import-position
from maxtext.trainers.pre_train import train  # pylint: disable=wrong-import-position


def _child(request):
  os.environ.update(request["env"])  # the run's variables on top of what MaxText's import set
  os.chdir(request["cwd"])
  log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  for fd in (1, 2):
    os.dup2(log, fd)
  # app.run ends with sys.exit, or an exception: either way this child ends as `python -m ...train` does, through
  # the interpreter's exit (atexit handlers, the telemetry's last records written at exit), never back in main's loop.
  app.run(train.main, argv=request["argv"])


def _wait(pid, timeout):
  deadline = time.monotonic() + timeout
  while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
      return os.waitstatus_to_exitcode(status)
    if time.monotonic() > deadline:
      os.kill(pid, signal.SIGKILL)
      os.waitpid(pid, 0)
      return -signal.SIGKILL
    time.sleep(0.2)


def main():
  for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      _child(request)
    REPLIES.write(json.dumps({"returncode": _wait(pid, request["timeout"])}) + "\n")
    REPLIES.flush()


if __name__ == "__main__":
  main()
