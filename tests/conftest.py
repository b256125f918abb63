"""Test-session settings shared by every test module."""

import jax

# The references are float64 computations with float32-level tolerances. On
# GPUs, float32 matmuls default to TF32-like precision (~1e-3 relative), which
# those tolerances reject; on CPU this setting changes nothing.
jax.config.update("jax_default_matmul_precision", "highest")
