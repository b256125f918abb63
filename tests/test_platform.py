"""The jax/jaxlib CPU deadlock that the pinned versions avoid.

jaxlib 0.10.x on CPU intermittently deadlocks in a compiled program that runs
several independent *batched* LAPACK calls (Cholesky, triangular solve, eigh),
the pattern a K-FAC decomposition step over stacked factors produces. This test
runs such a program many times in a subprocess with a deadline: it passes on the
pinned jax (constraints.txt) and must pass before the supported range in
pyproject.toml is widened.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import jax, jax.numpy as jnp
    import jax.scipy.linalg as jsl

    @jax.jit
    def decompose(stack_a, stack_b, stack_c):
      spd = lambda s: s @ jnp.swapaxes(s, -1, -2) + 1e-2 * jnp.eye(s.shape[-1])
      chol = jax.vmap(jnp.linalg.cholesky)(spd(stack_a))
      solved = jax.vmap(lambda l, b: jsl.solve_triangular(l, b, lower=True))(
          chol, stack_b)
      eigenvalues, _ = jax.vmap(jnp.linalg.eigh)(spd(stack_c))
      return chol.sum() + solved.sum() + eigenvalues.sum()

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    args = [jax.random.normal(k, (8, 64, 64)) for k in keys]
    for _ in range({runs}):
      decompose(*args).block_until_ready()
    print("ok")
""")


def test_batched_lapack_program_does_not_hang():
  runs = 150
  result = subprocess.run([sys.executable, "-c", PROGRAM.format(runs=runs)],
                          capture_output=True, text=True, timeout=240)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == "ok"
