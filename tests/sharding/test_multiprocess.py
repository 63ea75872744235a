"""Two processes on localhost (4 host devices each, CPU collectives over gloo) train the same NVFP4 step as one
process with 8 devices: the same losses, and the pass writes byte-identical modules in both processes."""

import json
import os
import socket
import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import json, os, sys
    pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // nproc}"
    import jax, jax.numpy as jnp
    if nproc > 1:
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
      jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                                 initialization_timeout=60)
    from jax.sharding import NamedSharding, PartitionSpec as P
    assert jax.device_count() == 8
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    k = jax.random.split(jax.random.key(0), 5)
    host = {"w1": [jax.random.normal(k[i], (64, 256)) * 0.125 for i in (0, 1)],
            "w2": [jax.random.normal(k[i], (256, 64)) * 0.0625 for i in (2, 3)]}
    x = jax.random.normal(k[4], (16, 32, 64))
    def place(a, spec):  # every process holds the whole host array and contributes its own shards
      s = NamedSharding(mesh, spec)
      return jax.make_array_from_callback(a.shape, s, lambda idx: a[idx])
    params = {"w1": [place(a, P(None, "model")) for a in host["w1"]],   # column parallel
              "w2": [place(a, P("model", None)) for a in host["w2"]]}   # row parallel
    xs = place(x, P("data"))
    def loss(p, x):
      for a, b in zip(p["w1"], p["w2"]):
        x = x + jax.nn.gelu(x @ a) @ b
      return jnp.mean(x ** 2)
    def step(p, x):
      l, g = jax.value_and_grad(loss)(p, x)
      return l, jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
    step = jax.jit(step, out_shardings=(NamedSharding(mesh, P()), jax.tree.map(lambda a: a.sharding, params)))
    losses = []
    for _ in range(3):
      l, params = step(params, xs)
      losses.append(float(l))
    print("RESULT", json.dumps(losses))
    if nproc > 1:
      jax.distributed.shutdown()
""")


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(dump_dir):
  env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_FP4") and k != "XLA_FLAGS"}
  # Every layer in NVFP4 (no head, no kept block). With a layer kept in high precision (the last is the loss's head
  # and the last block) the two runs part after step 0 under stochastic rounding only (nearest rounding: equal; no
  # pass: equal), though the pass's modules are byte-identical and the compiled programs differ only in XLA's thread
  # partitioning of loop fusions (8 vs 4 local devices): the digest in the rounding key turns any last-bit difference
  # of an operand into other random bits. Not yet explained; see README, Known limitations.
  return {**env, "XLA_FP4": "1", "XLA_FP4_STRICT": "1", "XLA_FP4_KEEP_HEAD": "0", "XLA_FP4_KEEP_FIRST": "0",
          "XLA_FP4_KEEP_LAST": "0", "XLA_FP4_DUMP_DIR": str(dump_dir)}


def _losses(stdout):
  return json.loads(next(l for l in stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])


def _dumps(d):
  return {name: (d / name).read_bytes() for name in sorted(os.listdir(d)) if name.endswith(".after.mlir")}


def test_two_processes_train_like_one(tmp_path):
  single = subprocess.run([sys.executable, "-c", PROGRAM, "0", "1", "0"], env=_env(tmp_path / "single"),
                          capture_output=True, text=True, timeout=300)
  assert single.returncode == 0, single.stderr[-4000:]
  port = str(_free_port())
  procs = [subprocess.Popen([sys.executable, "-c", PROGRAM, str(i), "2", port], env=_env(tmp_path / f"p{i}"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
  try:
    outs = [p.communicate(timeout=300) for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-4000:]
  expected = _losses(single.stdout)
  assert expected[-1] < expected[0], "the step trains"
  for out, _ in outs:
    assert _losses(out) == expected, (_losses(out), expected)
  first, second = _dumps(tmp_path / "p0"), _dumps(tmp_path / "p1")
  assert first and first == second, "the pass's output differs between the two processes"
  assert any(b"xla_fp4_qdq" in text for text in first.values()), "the pass rewrote the step"
