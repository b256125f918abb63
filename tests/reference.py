"""Independent float64 NumPy reference of K-FAC (KAISA's conventions).

Nothing here imports kfac_jax: models are re-implemented in NumPy with
hand-written backprop, convolutions with explicit loop im2col, and the K-FAC
algorithm follows the formulas of the issue/README directly.

The tests' float32 comparisons take their tolerance from the computation,
never a picked number: ``assert_float32_close`` (ε times the roundings a
value accumulates, its scale and the conditioning it goes through).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import itertools
import math

import numpy as np


def sym(c: np.ndarray) -> np.ndarray:
  return (c + c.T) / 2


def cov(x: np.ndarray) -> np.ndarray:
  return sym(x.T @ x / x.shape[0])


def damped_inverse(factor: np.ndarray, damping: float) -> np.ndarray:
  """``(F + λI)⁻¹`` in float64."""
  return np.linalg.inv(
    np.asarray(factor, np.float64) + damping * np.eye(len(factor))
  )


def assert_damped_inverse(result, factor: np.ndarray, damping: float) -> None:
  """``result`` is ``(F + λI)⁻¹`` up to a float32 inversion's error: the
  Cholesky factor's (n + 1 roundings, backward stable), the triangular
  inverse's and the product's (as many each), times κ(F + λI), of
  ‖(F + λI)⁻¹‖ (``assert_float32_close``). The roundings are counted as
  random, √(n + 1) for each n + 1: the worst case would allow 3% of the
  inverse at n = 1001, where 1e-6 is seen."""
  damped = np.asarray(factor, np.float64) + damping * np.eye(len(factor))
  values = np.linalg.eigvalsh(damped)
  assert_float32_close(
    result,
    damped_inverse(factor, damping),
    terms=3 * math.sqrt(len(factor) + 1),
    condition=values[-1] / values[0],
    scale=1 / values[0],
  )


def im2col(
  x: np.ndarray,
  window: tuple[int, int],
  strides: tuple[int, int],
  padding: tuple[tuple[int, int], tuple[int, int]],
) -> np.ndarray:
  """Loop im2col of NHWC ``x``: ``[B, Ho, Wo, kh*kw*C]``, (kh, kw, C) order."""
  x = np.pad(x, ((0, 0), padding[0], padding[1], (0, 0)))
  b, h, w, c = x.shape
  kh, kw = window
  sh, sw = strides
  ho = (h - kh) // sh + 1
  wo = (w - kw) // sw + 1
  out = np.zeros((b, ho, wo, kh * kw * c))
  for i in range(ho):
    for j in range(wo):
      patch = x[
        :, i * sh : i * sh + kh, j * sw : j * sw + kw, :
      ]  # [B, kh, kw, C]
      out[:, i, j, :] = patch.reshape(b, -1)
  return out


def im2col_nd(
  x: np.ndarray,
  window: tuple[int, ...],
  strides: tuple[int, ...],
  padding: str | tuple[tuple[int, int], ...],
  input_dilation: tuple[int, ...],
  kernel_dilation: tuple[int, ...],
) -> np.ndarray:
  """Loop im2col of channels-last ``x: [B, *spatial, C]``, any rank.

  Returns ``[B, *out_spatial, prod(window)*C]`` in ``(*window, C)`` order.
  ``padding``: explicit pairs, ``"VALID"``, ``"SAME"`` (lax's rule on the
  undilated input), ``"CIRCULAR"``/``"REFLECT"`` (Flax: pad the dilated
  window's ``((k-1)//2, k//2)`` by wrap/reflect, then valid) or ``"CAUSAL"``
  (1-D: ``(k-1)·dilation`` zeros on the left).
  """
  rank = len(window)
  dilated_window = [(k - 1) * d + 1 for k, d in zip(window, kernel_dilation)]
  if padding in ("CIRCULAR", "REFLECT"):
    pads = [((k - 1) // 2, k // 2) for k in dilated_window]
    mode = {"CIRCULAR": "wrap", "REFLECT": "reflect"}[padding]
    x = np.pad(x, [(0, 0)] + pads + [(0, 0)], mode=mode)
    padding = ((0, 0),) * rank
  elif padding == "CAUSAL":
    padding = ((dilated_window[0] - 1, 0),)
  elif padding == "VALID":
    padding = ((0, 0),) * rank
  elif padding == "SAME":
    pairs = []
    for size, k, s in zip(x.shape[1:-1], dilated_window, strides):
      total = max((-(-size // s) - 1) * s + k - size, 0)
      pairs.append((total // 2, total - total // 2))
    padding = tuple(pairs)
  # Input dilation: d-1 zeros between neighbours, then the explicit padding.
  spatial = [(n - 1) * d + 1 for n, d in zip(x.shape[1:-1], input_dilation)]
  dilated = np.zeros((x.shape[0], *spatial, x.shape[-1]), x.dtype)
  dilated[
    (slice(None),) + tuple(slice(None, None, d) for d in input_dilation)
  ] = x
  x = np.pad(dilated, [(0, 0)] + [tuple(p) for p in padding] + [(0, 0)])
  out_spatial = [
    (n - k) // s + 1 for n, k, s in zip(x.shape[1:-1], dilated_window, strides)
  ]
  out = np.zeros((x.shape[0], *out_spatial, math.prod(window) * x.shape[-1]))
  for position in itertools.product(*map(range, out_spatial)):
    taps = []
    for offset in itertools.product(*map(range, window)):
      index = tuple(
        p * s + o * d
        for p, s, o, d in zip(position, strides, offset, kernel_dilation)
      )
      taps.append(x[(slice(None),) + index])  # [B, C]
    out[(slice(None),) + position] = np.concatenate(taps, axis=-1)
  return out


def squared_weighted_loss(outputs, weights: np.ndarray):
  """``L = ½ Σ (y ⊙ W)²`` of NumPy or jax ``outputs`` y: ``dL/dy = y ⊙ W²``,
  known in closed form."""
  return 0.5 * ((outputs * weights) ** 2).sum()


def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray):
  """Mean loss and its gradient w.r.t. the logits."""
  z = logits - logits.max(axis=1, keepdims=True)
  p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
  n = logits.shape[0]
  loss = -np.log(p[np.arange(n), labels]).mean()
  onehot = np.zeros_like(p)
  onehot[np.arange(n), labels] = 1
  return loss, (p - onehot) / n


@dataclasses.dataclass
class LayerTensors:
  """One layer's reference rows and gradient matrix for one batch."""

  activation_rows: np.ndarray  # [N, dA]
  gradient_rows: np.ndarray  # [N, dG]
  gradient: np.ndarray  # [dA, dG]


def mlp_forward_backward(
  params: dict, x: np.ndarray, labels: np.ndarray, use_bias: bool
) -> dict[str, LayerTensors]:
  """Dense(hidden) -> tanh -> Dense(classes) -> mean softmax CE."""
  w1 = params["Dense_0"]["kernel"]
  w2 = params["Dense_1"]["kernel"]
  b1 = params["Dense_0"]["bias"] if use_bias else 0.0
  b2 = params["Dense_1"]["bias"] if use_bias else 0.0
  h = x @ w1 + b1
  a = np.tanh(h)
  z = a @ w2 + b2
  _, dz = softmax_cross_entropy(z, labels)
  dh = (dz @ w2.T) * (1 - a**2)

  def layer(inputs, cotangent):
    rows = _with_ones(inputs) if use_bias else inputs
    return LayerTensors(rows, cotangent, rows.T @ cotangent)

  return {"Dense_0": layer(x, dh), "Dense_1": layer(a, dz)}


def cnn_forward_backward(
  params: dict,
  x: np.ndarray,
  labels: np.ndarray,
  use_bias: bool,
  strides: tuple[int, int],
  padding: tuple[tuple[int, int], tuple[int, int]],
) -> dict[str, LayerTensors]:
  """Conv(3x3) -> relu -> flatten -> Dense(classes) -> mean softmax CE."""
  kernel = params["Conv_0"]["kernel"]
  kh, kw, _, features = kernel.shape
  patches = im2col(x, (kh, kw), strides, padding)
  b, ho, wo, _ = patches.shape
  spatial = ho * wo
  h = patches @ kernel.reshape(-1, features)
  if use_bias:
    h = h + params["Conv_0"]["bias"]
  a = np.maximum(h, 0).reshape(b, -1)
  w2 = params["Dense_0"]["kernel"]
  z = a @ w2 + (params["Dense_0"]["bias"] if use_bias else 0.0)
  _, dz = softmax_cross_entropy(z, labels)
  dh = (dz @ w2.T).reshape(h.shape) * (h > 0)

  conv_rows = patches.reshape(b * spatial, -1)
  if use_bias:
    conv_rows = _with_ones(conv_rows)
  conv_grad_rows = dh.reshape(b * spatial, features)
  dense_rows = _with_ones(a) if use_bias else a
  return {
    # KAISA: the whole patch matrix (ones column included) and g divided by S.
    "Conv_0": LayerTensors(
      conv_rows / spatial,
      conv_grad_rows / spatial,
      conv_rows.T @ conv_grad_rows,
    ),
    "Dense_0": LayerTensors(dense_rows, dz, dense_rows.T @ dz),
  }


def _with_ones(x: np.ndarray) -> np.ndarray:
  return np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)


@dataclasses.dataclass
class KFACReference:
  """Float64 K-FAC after the documented algorithm, one layer dict at a time."""

  damping: float
  factor_decay: float
  learning_rate: float
  kl_clip: float | None
  method: str = "eigen"
  factor_update_steps: int = 1
  inv_update_steps: int = 1
  outer_product: bool = True
  relative: bool = False  # damping_mode="relative" (normalized factors)
  momentum: float = 0.0  # the chained momentum KL clipping reads
  step: int = 0
  factors: dict = dataclasses.field(default_factory=dict)
  decomposition: dict = dataclasses.field(default_factory=dict)

  def update(
    self, batches: list[dict[str, LayerTensors]]
  ) -> dict[str, np.ndarray]:
    """One optimizer step over one or more micro-batches: P per layer."""
    names = list(batches[0])
    for name in names:
      if name not in self.factors:
        tensors = batches[0][name]
        self.factors[name] = (
          np.eye(tensors.activation_rows.shape[1]),
          np.eye(tensors.gradient_rows.shape[1]),
        )
    d = self.factor_decay
    if self.step % self.factor_update_steps == 0:
      for name in names:
        a_batch = np.mean([cov(b[name].activation_rows) for b in batches], 0)
        # Each micro-batch's loss is its own mean: its cotangents are k
        # times the concatenated batch's.
        g_batch = (
          np.mean([cov(b[name].gradient_rows) for b in batches], 0)
          / len(batches) ** 2
        )
        a, g = self.factors[name]
        self.factors[name] = (
          d * a + (1 - d) * a_batch,
          d * g + (1 - d) * g_batch,
        )
    if self.step % self.inv_update_steps == 0:
      for name in names:
        a, g = self.factors[name]
        if self.relative and self.method != "eigen":
          # (Â + √λI)⁻¹ ∇ (Ĝ + √λI)⁻¹, Â = A / (tr A / dA).
          root = np.sqrt(self.damping)
          self.decomposition[name] = tuple(
            np.linalg.inv(f / np.mean(np.diag(f)) + root * np.eye(len(f)))
            for f in (a, g)
          )
          continue
        if self.relative:
          # (Â ⊗ Ĝ + λI)⁻¹ vec(∇) by a dense solve of the Kronecker
          # matrix: row-major vec(Â ∇ Ĝ) = (Â ⊗ Ĝ) vec(∇). The state keeps
          # the eigenvalues of A and G as they are.
          normalized = [f / np.mean(np.diag(f)) for f in (a, g)]
          matrix = np.kron(*normalized) + self.damping * np.eye(len(a) * len(g))
          self.decomposition[name] = (
            None,
            np.maximum(np.linalg.eigvalsh(a), 0),
            None,
            np.maximum(np.linalg.eigvalsh(g), 0),
            matrix,
          )
          continue
        if self.method == "eigen":
          da, qa = np.linalg.eigh(a)
          dg, qg = np.linalg.eigh(g)
          da, dg = np.maximum(da, 0), np.maximum(dg, 0)
          frozen = 1 / (np.outer(da, dg) + self.damping)
          self.decomposition[name] = (qa, da, qg, dg, frozen)
        else:
          self.decomposition[name] = (
            np.linalg.inv(a + self.damping * np.eye(len(a))),
            np.linalg.inv(g + self.damping * np.eye(len(g))),
          )
    grads = {n: np.mean([b[n].gradient for b in batches], 0) for n in names}
    out = {}
    for name in names:
      grad = grads[name]
      if self.relative and self.method == "eigen":
        out[name] = np.linalg.solve(
          self.decomposition[name][-1], grad.reshape(-1)
        ).reshape(grad.shape)
      elif self.method == "eigen":
        qa, da, qg, dg, frozen = self.decomposition[name]
        scale = (
          frozen
          if self.outer_product
          else 1 / (np.outer(da, dg) + self.damping)
        )
        out[name] = qa @ ((qa.T @ grad @ qg) * scale) @ qg.T
      else:
        a_inv, g_inv = self.decomposition[name]
        out[name] = a_inv @ grad @ g_inv
    if self.kl_clip is not None:
      vg = (self.learning_rate / (1 - self.momentum)) ** 2 * sum(
        np.sum(out[n] * grads[n]) for n in names
      )
      nu = 1.0 if vg == 0 else min(1.0, np.sqrt(self.kl_clip / abs(vg)))
      out = {n: nu * p for n, p in out.items()}
    self.step += 1
    return out


# float32's machine epsilon 2⁻²³ ≈ 1.19e-7, twice its unit roundoff u.
EPS32 = float(np.finfo(np.float32).eps)


def assert_float32_close(
  actual,
  expected,
  *,
  terms: float,
  scale=None,
  condition: float = 1.0,
  err_msg: str = "",
) -> None:
  """``actual``, computed in float32, is ``expected`` up to float32 rounding.

  The error model (Higham's, first order): each float32 operation rounds
  with relative error at most u = ε/2. A value that accumulates ``terms``
  roundings on magnitudes up to ``scale`` (a sum or dot of ``terms``
  products; through a chain of layers, the contraction lengths met forward
  and backward, added) is within terms·u·scale of the exact one, so two
  computations of it (two code paths, or float32 against a float64
  reference) are within terms·ε·scale of each other. A solve or an inverse
  multiplies that by the ``condition`` number it goes through. Worst case
  (every rounding in one direction), not the √terms of random rounding.

  Absolute, every entry against ``scale`` (default: max |expected|; an
  array gives each entry its own), not relative: cancellation leaves a small
  entry with the large terms' error. Integer arrays (counts) compare exactly.
  """
  if not np.issubdtype(np.asarray(expected).dtype, np.inexact):
    np.testing.assert_array_equal(actual, expected, err_msg=err_msg)
    return
  expected = np.asarray(expected, np.float64)
  if scale is None:
    scale = np.abs(expected).max(initial=0.0)
  atol = terms * condition * EPS32 * scale
  actual = np.asarray(actual, np.float64)
  if np.ndim(atol) == 0:
    np.testing.assert_allclose(
      actual, expected, rtol=0, atol=atol, err_msg=err_msg
    )
    return
  excess = np.abs(actual - expected) - atol
  assert actual.shape == expected.shape and np.all(excess <= 0), (
    f"{err_msg}: {np.sum(~(excess <= 0))} entries beyond terms={terms}, "
    f"condition={condition:g} roundings of their scale; actual {actual}, "
    f"expected {expected}"
  )


def largest(arrays) -> float:
  """max |entry| over ``arrays`` (a pytree's leaves): a normwise ``scale``
  for a whole update, whose rounding comes from every layer's."""
  return max(
    float(np.abs(np.asarray(a, np.float64)).max(initial=0.0)) for a in arrays
  )


def running_factor_scale(factor, identity_weight: float) -> np.ndarray:
  """``assert_float32_close``'s ``scale`` for a running factor
  ``w·I + (batch covariances)``: each entry's parts' magnitudes, the
  identity's ``w`` on the diagonal plus the batch part's largest entry (on
  its diagonal, as of any covariance)."""
  identity = identity_weight * np.eye(len(factor))
  return identity + np.abs(np.asarray(factor, np.float64) - identity).max()


def kfac_state(state):
  """The K-FAC state (running ``factors`` and ``preconditioners``) inside an
  optimizer's state of tuples and mappings; None if there is none."""
  if hasattr(state, "factors") and hasattr(state, "preconditioners"):
    return state
  if isinstance(state, collections.abc.Mapping):
    state = state.values()
  elif not isinstance(state, (tuple, list)):
    return None
  return next(
    (found for found in map(kfac_state, state) if found is not None), None
  )


def kfac_condition(
  factors, damping: float, relative: bool = False, method: str = "eigen"
) -> float:
  """The largest ``κ(A ⊗ G + λI) = (‖A‖‖G‖ + λ)/(λmin(A)λmin(G) + λ)`` over
  ``factors`` (``{layer: (A, G)}``, stacked layers' factors too); with
  ``relative`` damping of the normalized factors ``Â``, ``Ĝ``, and for the
  inverse method ``κ((Â + √λI) ⊗ (Ĝ + √λI))``.

  First-order perturbation of the solve ``P = M⁻¹ vec(∇)``: rounding of
  relative size δ in ``M`` (the factors) or in ``∇`` moves ``P`` by up to
  ``κ(M)·δ·‖P‖``, so a K-FAC update carries its inputs' rounding times this
  ``condition`` (``assert_float32_close``)."""
  worst = 1.0
  for a, g in factors.values():
    ea = np.linalg.eigvalsh(np.asarray(a, np.float64)).clip(0)
    eg = np.linalg.eigvalsh(np.asarray(g, np.float64)).clip(0)
    if relative:
      ea = ea / ea.mean(axis=-1, keepdims=True)
      eg = eg / eg.mean(axis=-1, keepdims=True)
      if method != "eigen":
        root = np.sqrt(damping)
        worst = max(
          worst,
          float(
            np.max(
              (ea[..., -1] + root)
              * (eg[..., -1] + root)
              / ((ea[..., 0] + root) * (eg[..., 0] + root))
            )
          ),
        )
        continue
    top = ea[..., -1] * eg[..., -1] + damping
    worst = max(worst, float(np.max(top / (ea[..., 0] * eg[..., 0] + damping))))
  return worst


def assert_member_stats(stats, index: int, alone, *, terms: float) -> None:
  """Member ``index`` of stats captured under a ``vmap`` equals ``alone``,
  the stats of that member's own call: the same layers, and each layer's
  inputs and output cotangents, up to ``terms`` roundings
  (``assert_float32_close``)."""
  assert sorted(stats) == sorted(alone)
  for name, single in alone.items():
    mapped = stats[name]
    for member, expected in zip(
      (*mapped.inputs, *mapped.output_cotangents),
      (*single.inputs, *single.output_cotangents),
    ):
      assert_float32_close(member[index], expected, terms=terms, err_msg=name)
