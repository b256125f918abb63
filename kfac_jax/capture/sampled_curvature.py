"""Surrogate losses whose gradients sample the Gauss-Newton matrix.

K-FAC's ``G`` factor is built from the output cotangents the capture sees.
Those of the training loss give the *empirical* Fisher ``E[∇ℓ ∇ℓᵀ]``, which
shrinks as the loss is fitted and is a poor curvature model (Kunstner et al.,
2019). The Gauss-Newton matrix ``Jᵀ H J`` (``H = ∇²ℓ`` on the network's
outputs ``f``) is what K-FAC approximates (Martens & Grosse, 2015); an unbiased
sample of it needs cotangents ``u`` with ``E[u uᵀ] = H``.

Each function here returns the scalar

  ``s = (1/N) Σᵢ uᵢᵀ fᵢ``,   ``u = stop_gradient(sample)``,   ``E[uᵢ uᵢᵀ] = Hᵢ``

over the ``N`` examples (all leading axes of ``outputs``; the last is the
output dimension). Its cotangent on every layer's output is ``Jᵢᵀ uᵢ / N``,
on the scale of a mean loss's, so ``kfac_jax.value_grad_and_stats`` of a
function returning ``s`` gives stats that replace the loss's in
``tx.update(..., kfac_stats=...)``, in either damping convention. The
gradients of ``s`` are meaningless; the parameters' gradients come from the
training loss. ``Hᵢ`` is the Hessian of the per-example loss as written in
each docstring (summed over the last axis; averaging over it divides ``H``
by its size, which a fixed damping or the adaptive mode absorbs). For a
softmax classifier::

  def curvature_fn(params, x, key):
    logits = model.apply({"params": params}, x)
    return kfac_jax.sampled_curvature.softmax_cross_entropy(logits, key)

  _, _, stats = kfac_jax.value_grad_and_stats(curvature_fn)(params, x, key)

The stats may come from fewer examples than the gradient (a curvature
mini-batch, ``x[:k]``): factor statistics cost ``O(k)``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _check(outputs: jax.Array, key: jax.Array, caller: str) -> None:
  """Outputs ``[..., outputs]`` of a real floating dtype and one PRNG key."""
  if not jnp.issubdtype(jnp.result_type(outputs), jnp.floating):
    raise TypeError(
      f"sampled_curvature.{caller}: the outputs must be floating-point "
      f"(the network's logits); got dtype {jnp.result_type(outputs)}."
    )
  if jnp.ndim(outputs) < 1:
    raise ValueError(
      f"sampled_curvature.{caller}: outputs need an output "
      "axis (the last); got a scalar."
    )
  dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
  typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
  # jax.random.PRNGKey(seed): uint32 [2] for threefry, [4] for rbg.
  raw = dtype == jnp.uint32 and shape is not None and len(shape) == 1
  if not ((typed and shape == ()) or raw):
    raise TypeError(
      f"sampled_curvature.{caller}: key must be one JAX PRNG key "
      f"(jax.random.key(seed), a fresh one each step); got {key!r}."
    )


def _surrogate(outputs: jax.Array, cotangents: jax.Array) -> jax.Array:
  """``Σ stop_gradient(u) ⊙ f / N``, float32; ``N``: examples in ``outputs``."""
  examples = math.prod(outputs.shape[:-1])
  cotangents = jax.lax.stop_gradient(cotangents).astype(outputs.dtype)
  return jnp.sum(cotangents * outputs, dtype=jnp.float32) / examples


def sigmoid_cross_entropy(logits: jax.Array, key: jax.Array) -> jax.Array:
  """For ``ℓ = Σ_k sigmoid_binary_cross_entropy(f_k, y_k)`` (any targets).

  ``H = diag(p(1 − p))`` with ``p = sigmoid(f)``, sampled by curvature
  propagation (Martens et al., 2012): ``u = ε ⊙ √(p(1 − p))`` with Rademacher
  ``ε``, whose ``E[u uᵀ] = H`` exactly.

  Args:
    logits: ``[..., outputs]``.
    key: a JAX PRNG key (a fresh one each step).
  """
  _check(logits, key, "sigmoid_cross_entropy")
  probabilities = jax.nn.sigmoid(logits.astype(jnp.float32))
  signs = jax.random.rademacher(key, logits.shape, jnp.float32)
  return _surrogate(
    logits, signs * jnp.sqrt(probabilities * (1 - probabilities))
  )


def softmax_cross_entropy(logits: jax.Array, key: jax.Array) -> jax.Array:
  """For ``ℓ = −log softmax(f)_y`` (any targets, one-hot or soft summing to 1).

  ``H = diag(p) − p pᵀ`` with ``p = softmax(f)`` is the covariance of a one-hot
  ``e_y`` with ``y ~ Categorical(p)``, so ``u = e_y − p`` (the Fisher
  sampled with the model's own predictions, as in Martens & Grosse).

  Args:
    logits: ``[..., classes]``.
    key: a JAX PRNG key (a fresh one each step).
  """
  _check(logits, key, "softmax_cross_entropy")
  logits32 = logits.astype(jnp.float32)
  sampled = jax.random.categorical(key, logits32)
  probabilities = jax.nn.softmax(logits32)
  one_hot = jax.nn.one_hot(sampled, logits.shape[-1], dtype=jnp.float32)
  return _surrogate(logits, one_hot - probabilities)


def squared_error(outputs: jax.Array, key: jax.Array) -> jax.Array:
  """For ``ℓ = ½ Σ_k (f_k − y_k)²``: ``H = I``, sampled as Rademacher ``u = ε``.

  Args:
    outputs: ``[..., outputs]``.
    key: a JAX PRNG key (a fresh one each step).
  """
  _check(outputs, key, "squared_error")
  return _surrogate(
    outputs, jax.random.rademacher(key, outputs.shape, jnp.float32)
  )
