"""All of a step's factor decompositions, batched by factor size.

Factors of equal size (A or G, of any layers) are stacked ``[k, d, d]`` and
decomposed by one ``vmap``ped call, or by ``lax.map`` over batches of
``batch_size`` factors when memory is tight (many scanned layers).

Except on the platforms a method names (``lax.platform_dependent``, decided
when the step is lowered for its platform), where each factor is decomposed
on its own:

* CPU, for every method: a batched LAPACK call loops over its stack on one
  thread, while independent calls run concurrently on XLA:CPU's thread
  pool. Same-sized factors still share their compiled kernels (XLA:CPU
  compiles identical kernels once), and no stacking copies are made.
* CUDA GPUs, for eigendecompositions: cuSOLVER's ``syevd`` on stacks is
  slower than one call per factor, while its Cholesky is faster stacked,
  so the inverse method stacks there.

``benchmarks/README.md``, *Decompositions one by one on CPU* and *NVIDIA
H100*, has the measurements (``benchmarks/decomposition_time.py``).

A method whose results can be cut back from those of ``diag(F, I)`` (the
inverse method: ``(diag(F, 1) + λI)⁻¹ = diag((F + λI)⁻¹, 1/(1 + λ))``) passes
``crop``, and a factor one row short of another factor's size is padded to
it. A hidden layer's G (its width) is one row short of the next layer's A
(that width plus the bias row), so an MLP's factors fall from two sizes per
width to one: half the distinct decomposition kernels for XLA to compile,
and larger stacks, for one row and column more of arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from kfac_jax.factors.running import LayerFactors

# factor [d, d], damping[, warm start [d, d]] -> per-factor results
# (eigenvalues/vectors or inverse).
FactorFn = Callable[..., tuple[jax.Array, ...]]
Results = tuple[jax.Array, ...]
Decomposed = dict[str, tuple[Results, Results]]
# {layer: (warm start of A, of G)}: the previous eigenbases, for a
# ``factor_fn(factor, damping, warm)`` that refines them.
WarmStarts = Mapping[str, tuple[jax.Array, jax.Array]]
# (factor_fn's results for diag(F, I) [size, size], d) -> those for F [d, d].
Crop = Callable[[Results, int], Results]


def padded_sizes(sizes: Iterable[int]) -> dict[int, int]:
  """``{d: d + 1}`` for each size ``d`` whose ``d + 1`` is also present.

  A size padded to is not padded itself (from the largest size down), so a
  factor is padded by one row at most: of 30, 31 and 32 rows, 31 is padded
  to 32 and 30 is left alone.
  """
  present = set(sizes)
  targets: dict[int, int] = {}
  for size in sorted(present, reverse=True):
    if size + 1 in present and size + 1 not in targets:
      targets[size] = size + 1
  return targets


def pad_with_identity(factor: jax.Array, size: int) -> jax.Array:
  """``diag(F, I)``: ``F [d, d]`` padded to ``[size, size]`` (``size ≥ d``)."""
  extra = size - factor.shape[-1]
  if extra == 0:
    return factor
  corner = jnp.eye(extra, dtype=factor.dtype)
  side = jnp.zeros((factor.shape[-1], extra), factor.dtype)
  return jnp.block([[factor, side], [side.T, corner]])


def _sizes(factors: Mapping[str, LayerFactors]) -> list[int]:
  return [factor.shape[-1] for pair in factors.values() for factor in pair]


def decompose_each(
  factors: Mapping[str, LayerFactors],
  factor_fn: FactorFn,
  damping: jax.Array,
  crop: Crop | None = None,
  warm: WarmStarts | None = None,
) -> Decomposed:
  """``{layer: (factor_fn(A), factor_fn(G))}``, one call per factor.

  ``crop``: pad factors to shared sizes (``padded_sizes``) and cut their
  results back with it; ``None``: no padding. ``warm``: passed to
  ``factor_fn`` as its third argument, per factor (never with ``crop``).
  """
  targets = padded_sizes(_sizes(factors)) if crop is not None else {}

  def decompose(factor, *start):
    size = factor.shape[-1]
    if size not in targets:
      return factor_fn(factor, damping, *start)
    assert crop is not None  # sizes are padded only with a crop
    return crop(
      factor_fn(pad_with_identity(factor, targets[size]), damping), size
    )

  def start(name: str, which: int) -> tuple[jax.Array, ...]:
    return () if warm is None else (warm[name][which],)

  return {
    name: (
      decompose(pair[0], *start(name, 0)),
      decompose(pair[1], *start(name, 1)),
    )
    for name, pair in factors.items()
  }


def decompose_stacked(
  factors: Mapping[str, LayerFactors],
  factor_fn: FactorFn,
  damping: jax.Array,
  batch_size: int | None = None,
  crop: Crop | None = None,
  warm: WarmStarts | None = None,
) -> Decomposed:
  """``decompose_each``'s result from one call per ``(size, dtype)`` stack.

  ``batch_size``: decompose at most this many factors of a stack at once
  (``lax.map`` over ``vmap``ped batches); ``None``: the whole stack.
  ``crop``: as for ``decompose_each`` (padded factors join the stack of the
  size they are padded to). ``warm``: as for ``decompose_each``, stacked
  with the factors.
  """
  targets = padded_sizes(_sizes(factors)) if crop is not None else {}
  groups: dict[tuple[int, jnp.dtype], list[tuple[str, int, jax.Array]]] = {}
  for name, layer_factors in factors.items():
    for which, factor in enumerate(layer_factors):
      size = targets.get(factor.shape[-1], factor.shape[-1])
      groups.setdefault((size, factor.dtype), []).append((name, which, factor))

  results: dict[str, list[Results | None]] = {
    name: [None, None] for name in factors
  }
  for (size, _), members in groups.items():
    stack = [
      jnp.stack([pad_with_identity(factor, size) for _, _, factor in members])
    ]
    if warm is not None:
      stack.append(jnp.stack([warm[name][which] for name, which, _ in members]))
    if batch_size is None or batch_size >= len(stack[0]):
      decomposed: Sequence[jax.Array] = jax.vmap(
        lambda operands: factor_fn(operands[0], damping, *operands[1:])
      )(stack)
    else:
      decomposed = lax.map(
        lambda operands: factor_fn(operands[0], damping, *operands[1:]),
        stack,
        batch_size=batch_size,
      )
    for index, (name, which, factor) in enumerate(members):
      member = tuple(array[index] for array in decomposed)
      if factor.shape[-1] != size:
        assert crop is not None  # sizes are padded only with a crop
        member = crop(member, factor.shape[-1])
      results[name][which] = member

  def filled(pair: list[Results | None]) -> tuple[Results, Results]:
    activation, gradient = pair
    assert activation is not None and gradient is not None  # all grouped
    return activation, gradient

  return {name: filled(pair) for name, pair in results.items()}


# Platforms (``lax.platform_dependent`` names) where factors are decomposed
# one call per factor unless a method says otherwise.
EACH_ON_CPU = ("cpu",)


def decompose_layers(
  factors: Mapping[str, LayerFactors],
  factor_fn: FactorFn,
  damping: jax.Array,
  batch_size: int | None = None,
  crop: Crop | None = None,
  each_on: Sequence[str] = EACH_ON_CPU,
  warm: WarmStarts | None = None,
) -> Decomposed:
  """Applies ``factor_fn`` to each A and G: singly on ``each_on``, else stacked.

  Args:
    factors: ``{layer: LayerFactors(A [dA, dA], G [dG, dG])}``.
    factor_fn: decomposition of one factor, ``vmap``-able.
    damping: λ, passed to every call.
    batch_size: bounds the factors decomposed at once, on every platform
      (``decompose_stacked``); ``None``: no bound.
    crop: cuts ``factor_fn``'s results for ``diag(F, I)`` back to those for
      ``F``; given, factors are padded to shared sizes (``padded_sizes``).
    each_on: the platforms (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``)
      where each factor gets its own call (``decompose_each``); the others
      stack them (``decompose_stacked``).
    warm: ``{layer: (start for A, start for G)}``, each ``[d, d]``, passed
      to ``factor_fn`` as a third argument; ``None``: ``factor_fn(F, λ)``.

  Returns:
    ``{layer: (factor_fn(A), factor_fn(G))}``.
  """
  stacked = lambda factors, damping, warm: decompose_stacked(
    factors, factor_fn, damping, batch_size, crop, warm
  )
  if batch_size is not None:
    return stacked(factors, damping, warm)
  each = lambda factors, damping, warm: decompose_each(
    factors, factor_fn, damping, crop, warm
  )
  return lax.platform_dependent(
    dict(factors),
    damping,
    None if warm is None else dict(warm),
    default=stacked,
    **{platform: each for platform in each_on},
  )
