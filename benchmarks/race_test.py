"""The convergence race's sweep grid (``race.sweep``), without running it.

Beside the module it checks, as optax keeps a ``_test.py`` beside each
module; ``pyproject.toml``'s ``testpaths`` collects it with ``tests/``.
"""

import argparse
import math

from benchmarks.race import sweep
from examples import tasks


def test_sweep_grid_of_learning_rates_and_adaptive_damping():
  """The sweep tries center × (1/3, 1, 3) of each optimizer's swept value
  (kfac_adaptive's λ₀ around kfac-jax's 150) and grows past a winning edge."""
  # The race's own grid logic, checked without running it.
  task = tasks.Task(
      name="toy", description="", metric="loss", higher_is_better=False,
      data=(), batch_size=1, init=None, loss_fn=None, evaluate=None)

  class Recorded:
    """The sweep's runs: the final loss is |log10(value / best)|."""

    def __init__(self, best):
      self.best, self.tried = best, []

    def run(self, phase, task, name, lr, seed, budget):
      del phase, task, name, seed, budget
      self.tried.append(lr)
      return dict(final=abs(math.log10(lr / self.best)))

  args = argparse.Namespace(center={}, max_extensions=2, min_damping=None)
  race = Recorded(best=15.0)
  best, finals = sweep(task, "kfac_adaptive", args, race, 1.0)
  assert race.tried == [50.0, 150.0, 450.0, 16.7, 5.57]
  assert best == 16.7 and sorted(finals) == [5.57, 16.7, 50.0, 150.0, 450.0]
  race = Recorded(best=1e-3)
  assert sweep(task, "adam", args, race, 1.0)[0] == 1e-3
  assert race.tried == [3.33e-4, 1e-3, 3e-3]
  # λ₀ stays within [min_damping, max_damping] = [1e-4, 1000]: past 450
  # the extension to 1350 made scale_by_kfac raise, ending the race.
  race = Recorded(best=5000.0)
  assert sweep(task, "kfac_adaptive", args, race, 1.0)[0] == 450
  assert race.tried == [50.0, 150.0, 450.0]
  args.center = {"kfac_adaptive": 500.0}
  race = Recorded(best=100.0)
  assert sweep(task, "kfac_adaptive", args, race, 1.0)[0] == 167
  assert race.tried == [167.0, 500.0, 55.7]
