"""The race's K-FAC contestants: what their swept value changes in a step."""

import jax
import numpy as np
import pytest

import kfac_jax
from benchmarks import race_optimizers
from examples import tasks
from tests import reference


def first_updates(name: str, lr: float) -> list[np.ndarray]:
  """Contestant ``name``'s first update at swept value ``lr``, on one
  batch of 4 sequences of the transformer race's task."""
  task = tasks.shakespeare_task(eval_examples=8, batch_size=4)
  params = task.init(0)
  x, y = (a[:4] for a in task.data)
  _, grads, stats = kfac_jax.value_grad_and_stats(task.loss_fn)(params, x, y)
  tx = race_optimizers.build_optimizer(name, lr, task).tx
  updates, _ = tx.update(grads, tx.init(params), params, kfac_stats=stats)
  return [np.asarray(u, np.float64) for u in jax.tree.leaves(updates)]


@pytest.mark.parametrize("name", race_optimizers.KL_SCALED)
def test_scaled_clip_makes_the_rate_scale_the_whole_step(name):
  """kfac_levers_scaled and the second-moment contestants (κ = 10·lr²,
  and AdamW's rate 0.01·lr on the params K-FAC leaves out): tripling the
  rate triples every entry of the step, clipped or not; kfac_levers (κ
  fixed at 0.1) clips its K-FAC layers' step at the larger rate, so it
  does not triple."""
  slow = first_updates(name, 0.1)
  fast = first_updates(name, 0.3)
  for got, want in zip(fast, slow):
    # Each entry against its own size: the two steps differ in κ's and
    # lr's roundings, κ/lr² (quotient, product), its square root and the
    # products by ν and lr, in the K-FAC scaling and in SGD's: 8 roundings
    # (AdamW's step, lr's and its own weight decay's: fewer).
    reference.assert_float32_close(
      got, 3 * want, terms=8, scale=np.abs(3 * want)
    )
  fixed_slow = first_updates("kfac_levers", 0.1)
  fixed_fast = first_updates("kfac_levers", 0.3)
  ratios = [
    np.linalg.norm(f) / np.linalg.norm(s)
    for f, s in zip(fixed_fast, fixed_slow)
    if np.linalg.norm(s) > 0
  ]
  assert min(ratios) < 2.0, ratios  # the clip binds: lr·ν no longer 3×
