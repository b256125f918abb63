"""Compile-time guard: the size of the lowered K-FAC step against Adam's.

A step's first call is spent compiling it, and XLA's compile time grows with
the program (on a GPU, every kernel is generated, and every matmul autotuned,
one by one). Timings are machine-dependent, so CI guards the program instead:
the StableHLO operations of the MNIST autoencoder's training step
(784-1000-500-250-30-250-500-1000-784), lowered for the CPU and for CUDA
(which needs no GPU), as a multiple of the Adam step's in the same lowering.

Measured on jax 0.9.2 (0.12.0.1 within 2 %): Adam 698 operations (710) on
both platforms; K-FAC eigen 2.79x, inverse 3.48x (cpu: its blocked
triangular solves), adaptive (eigen) 4.38x; relative damping's
normalizations added 0.14x and 0.20x. Each bound
leaves ~10 % above the larger: a change that grows the step past it must
show its compile time (benchmarks/compile_time.py) and move the bound
knowingly.
"""

from __future__ import annotations

import collections
import re

import jax
import optax
import pytest

import kfac_jax
from examples import models

PIXELS = models.MNIST_PIXELS
BATCH = 16  # the operation count does not depend on it

# K-FAC's step size, in Adam steps, per variant.
BOUNDS = {"eigen": 2.9, "inverse": 3.6, "adaptive": 4.8}

_OPERATION = re.compile(r"= \"?([a-z_]+\.[a-z_]+)")


def _loss(params, x):
  logits = models.Autoencoder().apply({"params": params}, x)
  return optax.sigmoid_binary_cross_entropy(logits, x).sum(-1).mean()


def _step(variant: str):
  """The jitted-to-be training step of ``variant`` and its optimizer."""
  if variant == "adam":
    tx = optax.adam(1e-3)

    def step(params, opt_state, x):
      loss, grads = jax.value_and_grad(_loss)(params, x)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    return step, tx
  if variant == "adaptive":
    tx = kfac_jax.scale_by_kfac(
      damping=1.0,
      kl_clip=None,
      inv_update_steps=5,
      adaptive=kfac_jax.AdaptiveConfig(),
      compute_method="eigen",
    )
  else:
    tx = optax.chain(
      kfac_jax.scale_by_kfac(
        learning_rate=1e-3,
        damping=1e-3,
        inv_update_steps=10,
        compute_method=variant,
      ),
      optax.sgd(1e-3, momentum=0.9),
    )

  def kfac_step(params, opt_state, x):
    loss, grads, stats = kfac_jax.value_grad_and_stats(_loss)(params, x)
    extra = {}
    if variant == "adaptive":
      extra["split_loss"] = kfac_jax.SplitLoss(
        lambda p: models.Autoencoder().apply({"params": p}, x),
        lambda logits: (
          optax.sigmoid_binary_cross_entropy(logits, x).sum(-1).mean()
        ),
      )
    updates, opt_state = tx.update(
      grads, opt_state, params, kfac_stats=stats, **extra
    )
    return optax.apply_updates(params, updates), opt_state, loss

  return kfac_step, tx


def operations(variant: str, platform: str) -> collections.Counter[str]:
  """StableHLO operations of ``variant``'s step lowered for ``platform``."""
  x = jax.random.uniform(jax.random.PRNGKey(0), (BATCH, PIXELS))
  params = models.Autoencoder().init(jax.random.PRNGKey(1), x[:1])["params"]
  step, tx = _step(variant)
  opt_state = jax.eval_shape(tx.init, params)
  lowered = (
    jax.jit(step)
    .trace(params, opt_state, x)
    .lower(lowering_platforms=(platform,))
  )
  return collections.Counter(_OPERATION.findall(lowered.as_text()))


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_kfac_steps_stay_within_their_size_in_adam_steps(platform):
  adam = sum(operations("adam", platform).values())
  assert adam > 500  # the count reads the program (a parse that broke: ~0)
  for variant, bound in BOUNDS.items():
    size = sum(operations(variant, platform).values())
    assert size <= bound * adam, (variant, platform, size, adam, size / adam)


def test_the_cuda_lowering_decomposes_on_cusolver():
  """The count above is of a CUDA program: its solvers are cuSOLVER's."""
  text = " ".join(operations("eigen", "cuda"))
  assert "stablehlo.custom_call" in text
  x = jax.random.uniform(jax.random.PRNGKey(0), (BATCH, PIXELS))
  params = models.Autoencoder().init(jax.random.PRNGKey(1), x[:1])["params"]
  step, tx = _step("eigen")
  lowered = (
    jax.jit(step)
    .trace(params, jax.eval_shape(tx.init, params), x)
    .lower(lowering_platforms=("cuda",))
  )
  assert "cusolver" in lowered.as_text()
  assert "lapack" not in lowered.as_text()
