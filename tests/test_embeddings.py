"""Embeddings: left to the chained optimizer unless requested, left alone when
the chain withholds them, and not captured when also used through
``attend``."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import kfac_jax
from tests import reference

DAMPING = 0.01
DECAY = 0.5
close = reference.assert_float32_close


class EmbedThenDense(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    return nn.Dense(3, name="dense")(nn.Embed(7, 4, name="embed")(tokens))


def _embed_then_dense_problem(seed: int):
  """``EmbedThenDense`` on random tokens under
  ``reference.squared_weighted_loss``: (params, tokens, weights, layer table,
  grads, stats)."""
  model = EmbedThenDense()
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, 7, size=(5, 6)), jnp.int32)
  params = model.init(jax.random.PRNGKey(0), tokens)["params"]
  weights = rng.uniform(0.5, 1.5, size=(5, 6, 3)).astype(np.float32)
  loss_fn = lambda p: reference.squared_weighted_loss(
    model.apply({"params": p}, tokens), weights
  )
  table = kfac_jax.trace_layers(loss_fn, params)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  return params, tokens, weights, table, grads, stats


def test_embeddings_pass_through_unless_requested():
  params, tokens, weights, table, grads, stats = _embed_then_dense_problem(4)
  assert table["embed"].kernel_key == "embedding"
  np.testing.assert_array_equal(stats["embed"].inputs[0], tokens)

  # Default: the embedding table goes to the chained optimizer untouched.
  tx = kfac_jax.scale_by_kfac(
    damping=DAMPING, factor_decay=DECAY, kl_clip=None, layers=table
  )
  state = tx.init(params)
  updates, _ = tx.update(grads, state, params, kfac_stats=stats)
  assert list(state.factors) == ["dense"]
  np.testing.assert_array_equal(
    updates["embed"]["embedding"], grads["embed"]["embedding"]
  )

  # Requested: a dense layer on one-hot ids, A = diag(token frequencies).
  tx = kfac_jax.scale_by_kfac(
    damping=DAMPING,
    factor_decay=DECAY,
    kl_clip=None,
    layers=table,
    precondition_embeddings=True,
    damping_mode="absolute",
    compute_method="eigen",
  )
  state = tx.init(params)
  updates, state = tx.update(grads, state, params, kfac_stats=stats)
  one_hot = np.eye(7)[np.asarray(tokens).reshape(-1)]
  embedding = np.asarray(params["embed"]["embedding"], np.float64)
  dense = {k: np.asarray(v, np.float64) for k, v in params["dense"].items()}
  h = one_hot @ embedding
  y = h @ dense["kernel"] + dense["bias"]
  dy = y * weights.reshape(-1, 3).astype(np.float64) ** 2
  dh = dy @ dense["kernel"].T
  ref = reference.KFACReference(
    damping=DAMPING, factor_decay=DECAY, learning_rate=1.0, kl_clip=None
  )
  expected = ref.update(
    [{"embed": reference.LayerTensors(one_hot, dh, one_hot.T @ dh)}]
  )
  a, _ = ref.factors["embed"]
  # Token counts over 30 rows, / 30, the mix.
  close(
    state.factors["embed"].activation_factor,
    a,
    terms=30 + 1 + 2,
    scale=reference.running_factor_scale(a, DECAY),
  )
  # The cotangents (the dense's dot of 4, the bias, ·W², the dot of 3 back),
  # squared in G, the sums over 30 rows, the eigh (7² + 4²), through K-FAC's
  # conditioning.
  close(
    updates["embed"]["embedding"],
    expected["embed"],
    terms=2 * (4 + 1 + 2 + 3) + 30 + 7**2 + 4**2,
    condition=reference.kfac_condition(ref.factors, DAMPING),
  )
  with pytest.raises(ValueError, match="precondition_embeddings.*trace_layers"):
    kfac_jax.scale_by_kfac(precondition_embeddings=True)


@pytest.mark.parametrize("labels_as", ["leaves", "prefix"])
def test_an_embedding_withheld_by_the_chain_is_left_alone(labels_as):
  """precondition_embeddings inside optax.multi_transform, Adam on the
  Embed's table (labelled per leaf, or per module): the Dense layer is
  preconditioned as without the embedding, the table gets Adam's update."""
  params, _, _, table, grads, stats = _embed_then_dense_problem(8)
  labels = {
    "embed": ({"embedding": "adam"} if labels_as == "leaves" else "adam"),
    "dense": {"kernel": "kfac", "bias": "kfac"},
  }
  kfac = kfac_jax.scale_by_kfac(
    damping=DAMPING,
    factor_decay=DECAY,
    kl_clip=None,
    layers=table,
    precondition_embeddings=True,
  )
  tx = optax.multi_transform({"kfac": kfac, "adam": optax.adam(1e-3)}, labels)
  state = tx.init(params)
  updates, _ = tx.update(grads, state, params, kfac_stats=stats)
  assert list(state.inner_states["kfac"].inner_state.factors) == ["dense"]
  alone = kfac_jax.scale_by_kfac(
    damping=DAMPING, factor_decay=DECAY, kl_clip=None, layers=table
  )
  expected, alone_state = alone.update(
    grads, alone.init(params), params, kfac_stats=stats
  )
  # The same step on the same inputs in another program: its factor sums
  # (30 rows) and eigh (to 5² + 3²) may round differently, through K-FAC's
  # conditioning.
  tolerance = dict(
    terms=30 + 5**2 + 3**2,
    condition=reference.kfac_condition(alone_state.factors, DAMPING),
    scale=reference.largest(jax.tree.leaves(expected["dense"])),
  )
  jax.tree.map(
    lambda a, b: close(a, b, **tolerance), updates["dense"], expected["dense"]
  )
  adam = optax.adam(1e-3)
  # Adam's elementwise chain: 10 roundings.
  close(
    updates["embed"]["embedding"],
    adam.update(grads["embed"], adam.init(params["embed"]))[0]["embedding"],
    terms=10,
  )


class TiedEmbedding(nn.Module):
  """Logits through the embedding table (``attend``), as Flax's LM examples
  tie them."""

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(7, 4, name="embed")
    return embed.attend(nn.Dense(4, name="dense")(embed(tokens)))


class NnxTiedEmbedding(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(7, 4, rngs=rngs)
    self.dense = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, tokens):
    return self.embed.attend(self.dense(self.embed(tokens)))


@pytest.mark.parametrize("front_end", ["linen", "nnx"])
def test_an_embedding_also_used_through_attend_is_not_captured(front_end):
  """Its lookup's factors miss the attend use: rows only attend reaches got
  ∇/λ. Not captured, it goes to the chained optimizer, with a warning when
  precondition_embeddings asked for it."""
  rng = np.random.default_rng(6)
  tokens = jnp.asarray(rng.integers(0, 3, size=(5, 6)), jnp.int32)
  if front_end == "linen":
    model = TiedEmbedding()
    params = model.init(jax.random.PRNGKey(0), tokens)["params"]
    loss_fn = lambda p: jnp.sum(model.apply({"params": p}, tokens) ** 2)
  else:
    params = NnxTiedEmbedding(nnx.Rngs(0))
    loss_fn = lambda m: jnp.sum(m(tokens) ** 2)
  table = kfac_jax.trace_layers(loss_fn, params)
  _, grads, stats = kfac_jax.value_grad_and_stats(loss_fn)(params)
  assert list(table) == list(stats) == ["dense"]
  if front_end == "nnx":
    grads = nnx.to_pure_dict(grads)
    params = nnx.to_pure_dict(nnx.state(params, nnx.Param))
  tx = kfac_jax.scale_by_kfac(
    damping=DAMPING, kl_clip=None, layers=table, precondition_embeddings=True
  )
  with pytest.warns(UserWarning, match="'embed'.*attend"):
    state = tx.init(params)
  updates, _ = tx.update(grads, state, params, kfac_stats=stats)
  assert list(state.factors) == ["dense"]
  np.testing.assert_array_equal(
    updates["embed"]["embedding"], grads["embed"]["embedding"]
  )
  assert not np.array_equal(
    updates["dense"]["kernel"], grads["dense"]["kernel"]
  )
