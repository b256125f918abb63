"""The convergence race's sweep grid (``race.sweep``), without running it.

Beside the module it checks, as optax keeps a ``_test.py`` beside each
module; ``pyproject.toml``'s ``testpaths`` collects it with ``tests/``.
"""

import argparse
import math

from benchmarks.race import sweep
from examples import tasks


def toy_task() -> tasks.Task:
  """A task with no data or model: for the race's logic, not its runs."""
  return tasks.Task(
    name="toy",
    description="",
    metric="loss",
    higher_is_better=False,
    data=(),
    batch_size=1,
    init=None,
    loss_fn=None,
    evaluate=None,
  )


def test_sweep_grid_of_learning_rates_and_adaptive_damping():
  """The sweep tries center × (1/3, 1, 3) of each optimizer's swept value
  (kfac_adaptive's λ₀ around kfac-jax's 150) and grows past a winning edge."""
  # The race's own grid logic, checked without running it.
  task = toy_task()

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


def test_race_takes_the_sweeps_seed_zero_run_and_leaves_out_what_cannot_run(
  tmp_path, monkeypatch
):
  """At the sweep's budget the final seed-0 run of the winner is the
  sweep's run (not trained again); a contestant the task cannot run
  (the adaptive mode without a split loss) is left out."""
  import json  # pylint: disable=g-import-not-at-top

  from benchmarks import race  # pylint: disable=g-import-not-at-top

  trained = []

  def train_run(task, optimizer, seed, budget, *args, **kwargs):
    del task, budget, args, kwargs
    name, lr = optimizer
    trained.append((name, lr, seed))
    return dict(
      optimizer=name,
      final=abs(math.log10(lr / 1e-3)) + seed,
      steps=1,
      ms_per_step=1.0,
      compile_seconds=0.0,
      diverged=False,
      curve=[],
    )

  monkeypatch.setattr(race.race_runs, "train_run", train_run)
  monkeypatch.setattr(
    race.race_optimizers,
    "build_optimizer",
    lambda name, lr, *args, **kwargs: (name, lr),
  )
  args = argparse.Namespace(
    resume=None,
    inv_dtype="float32",
    curvature="subset",
    curvature_examples=250,
    min_damping=None,
    eval_examples=None,
    eval_every=10.0,
    max_steps=None,
    no_progress=True,
    no_sweep=False,
    optimizers=["adam", "kfac_adaptive"],
    center={},
    max_extensions=0,
    budget=5.0,
    sweep_budget=None,
    seeds=[0, 1],
    clock="cpu",
  )
  task = toy_task()
  contest = race.Race(args, tmp_path / "race.json", {})
  result = race.race_task(task, args, contest)
  assert trained == [
    ("adam", 3.33e-4, 0),
    ("adam", 1e-3, 0),
    ("adam", 3e-3, 0),
    ("adam", 1e-3, 1),
  ]
  assert list(result["finals"]) == ["adam"]
  first, second = result["finals"]["adam"]
  assert first["reused"] == "sweep" and first["phase"] == "final"
  assert "reused" not in second
  recorded = json.loads((tmp_path / "race.json").read_text())["runs"]
  assert [r["phase"] for r in recorded] == ["sweep"] * 3 + ["final"] * 2
