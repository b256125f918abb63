"""Test-session settings shared by every test module."""

import os

import jax

# The references are float64 computations with float32-level tolerances. On
# GPUs, float32 matmuls default to TF32-like precision (~1e-3 relative), which
# those tolerances reject; on CPU this setting changes nothing. The variable
# carries the setting into the tests' subprocesses (e.g. the determinism
# test compares bits across processes).
os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
jax.config.update("jax_default_matmul_precision", "highest")
