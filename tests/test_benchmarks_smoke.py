"""The benchmark scripts still run (tiny sizes); no timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import kfac_jax
from benchmarks.race_test import toy_task
from examples import flops, models, targets, tasks, training

REPO = pathlib.Path(__file__).resolve().parents[1]


def run_smoke(
  module: str, out, *extra: str, **env: str
) -> subprocess.CompletedProcess[str]:
  """Runs ``python -m benchmarks.<module> --smoke`` from the repository root."""
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      f"benchmarks.{module}",
      "--smoke",
      "--no-progress",
      "--out",
      str(out),
      *extra,
    ],
    cwd=REPO,
    env=dict(os.environ, **env),
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def test_step_time_smoke(tmp_path):
  result = run_smoke("step_time", tmp_path, "--kfac-revs", "HEAD")
  (results_file,) = tmp_path.glob("step_time_*.json")
  results = json.loads(results_file.read_text())
  assert results  # a non-empty record of the run
  for variant in (
    "sgd",
    "kfac-eigen",
    "kfac-inverse",
    "kfac-inverse-gfs",
    "kfac-adaptive",
  ):
    assert variant in result.stdout
  # --kfac-revs: the committed package, timed beside the working tree's.
  head = subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"],
    cwd=REPO,
    capture_output=True,
    text=True,
    check=True,
  ).stdout.strip()
  timed = results["results"][0]["variants"]
  for variant in (
    "kfac-eigen",
    "kfac-inverse",
    "kfac-inverse-gfs",
    "kfac-adaptive",
  ):
    assert timed[f"{variant}@{head}"]["n_plain"] > 0


def test_compile_time_smoke(tmp_path):
  result = run_smoke("compile_time", tmp_path, "--kfac-revs", "HEAD")
  (results_file,) = tmp_path.glob("compile_time_*.json")
  rows = {
    row["variant"]: row for row in json.loads(results_file.read_text())["rows"]
  }
  head = subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"],
    cwd=REPO,
    capture_output=True,
    text=True,
    check=True,
  ).stdout.strip()
  # SGD once; K-FAC from the working tree and from HEAD.
  assert set(rows) == {"sgd", "kfac-inverse-gfs", f"kfac-inverse-gfs@{head}"}
  for row in rows.values():
    assert row["compile_s_min"] > 0 and row["lower_s_min"] > 0
    assert row["variant"] in result.stdout
  # K-FAC's program holds far more kernels than SGD's; deduplication can
  # only merge kernels.
  assert rows["kfac-inverse-gfs"]["fusions"] > 2 * rows["sgd"]["fusions"]
  for row in rows.values():
    assert 0 < row["distinct_fusions"] <= row["fusions"]


def test_decomposition_time_smoke(tmp_path):
  result = run_smoke("decomposition_time", tmp_path, JAX_PLATFORMS="cpu")
  (results_file,) = tmp_path.glob("decomposition_time_*.json")
  rows = json.loads(results_file.read_text())["results"]
  methods = (
    "eigen",
    "eigen subspace k=0",
    "eigen subspace k=1",
    "eigen subspace k=2",
    "inverse",
  )
  assert sorted((row["method"], row["layout"]) for row in rows) == [
    (method, layout)
    for method in methods
    for layout in ("one by one", "stacked")
  ]
  for row in rows:
    # The subspace rows refine bases one averaging step old: no fallback.
    assert row["rejected"] == 0 and row["fallbacks"] == 0
    assert row["median_ms"] > 0
    # On CPU the library decomposes one factor per call for both methods.
    assert row["library_choice"] == (row["layout"] == "one by one")
  assert "| eigen | one by one |" in result.stdout
  sizes = [
    row["size"]
    for row in json.loads(results_file.read_text())["orthogonalization"]
  ]
  assert sizes == sorted(sizes) and len(sizes) == 4


def _autoencoder_shapes(batch):
  widths = (784, 1000, 500, 250, 30, 250, 500, 1000, 784)
  return [
    dict(name=str(i), rows=batch, fan_in=a, fan_out=b, bias=1, conv=0)
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))
  ]


def test_flop_floor_of_the_issue_autoencoder():
  """The SGD count against XLA's count of the compiled SGD step, and the
  issue's floors at batch 256 (about 3.8× SGD inverse, 5.9× eigen) from its
  ``6·batch·Σ in·out``, which also counts the data's input gradient."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  floor = lambda batch, method, gfs: flops.flop_floor(
    _autoencoder_shapes(batch), method, 10, 4.0, 1.0, gfs
  )

  model = models.Autoencoder()
  x = jnp.full((256, 784), 0.5)
  params = model.init(jax.random.PRNGKey(0), x[:1])["params"]
  sgd = optax.sgd(0.1, momentum=0.9)

  def step(params, opt_state):
    grads = jax.grad(
      lambda p: models.autoencoder_losses(
        model.apply({"params": p}, x), x
      ).mean()
    )(params)
    updates, opt_state = sgd.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  # XLA also counts the elementwise work: 3.98 against 3.95 GFLOP here.
  xla = flops.compiled_flops(step, params, sgd.init(params))
  counted = floor(256, "inverse", False)["sgd_flops"]
  assert counted < xla < 1.02 * counted, (counted, xla)

  data_gradient = 2 * 256 * 784 * 1000
  for method, issue_floor in (("inverse", 3.83), ("eigen", 5.90)):
    f = floor(256, method, False)
    kfac = (f["floor_plain_x"] - 1) * f["sgd_flops"]
    assert abs(1 + kfac / (f["sgd_flops"] + data_gradient) - issue_floor) < 0.01
  for method in ("inverse", "eigen"):
    dense = floor(256, method, False)["precondition_flops"]
    factored = floor(256, method, True)["precondition_flops"]
    # Every layer's first pair is cheaper factored at 256 rows, e.g. the
    # 785 × 1000 layer's 2·256·(785² + 1000² + 785·1000) against
    # 2·785·1000·1785 FLOPs.
    first_pairs = dense / (2 if method == "eigen" else 1)
    assert factored < dense - 0.4 * first_pairs
    # At 2048 rows no layer's is (the 250 × 30 pair: 2048 > 29 rows).
    assert (
      floor(2048, method, True)["precondition_flops"]
      == floor(2048, method, False)["precondition_flops"]
    )


def test_race_flops_match_the_shapes_and_share_a_forward_pass(tmp_path):
  """XLA's counts of the race step's model passes against the shape counts.

  Each piece within 2 % of its count from the layer shapes (XLA also counts
  the elementwise work), and the capture and the quadratic model jitted
  together cost one forward pass over the curvature examples (``2·M·W``,
  1.415 GFLOP) less than apart, and so do all three with the gradient's loss
  split at the curvature examples (``examples.training.curvature_shared_loss``)
  against the gradient apart.
  """
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "benchmarks.race_flops",
      "--no-progress",
      "--out",
      str(tmp_path),
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  (path,) = tmp_path.glob("race_flops_*.json")
  counts = json.loads(path.read_text())
  xla, shapes = counts["xla_flops"], counts["shape_flops"]
  assert sorted(shapes) == ["capture", "gradient", "quadratic_model"]
  for name, count in shapes.items():
    assert abs(xla[name] / count - 1) < 0.02, (name, xla[name], count)
  weights = sum(
    layer["fan_in"] * layer["fan_out"] for layer in _autoencoder_shapes(1)
  )
  forward = 2 * counts["curvature_examples"] * weights
  shared = (
    xla["capture"] + xla["quadratic_model"] - xla["capture_and_quadratic_model"]
  )
  assert abs(shared / forward - 1) < 0.05, (shared, forward)
  # With the gradient's loss split at the curvature examples, its forward
  # pass over them is shared too.
  shared = (
    xla["gradient"]
    + xla["capture_and_quadratic_model"]
    - xla["all_gradient_split"]
  )
  assert abs(shared / forward - 1) < 0.05, (shared, forward)


def test_scaling_smoke(tmp_path):
  # Simulated CPU devices also where an accelerator is present.
  run_smoke("scaling", tmp_path, JAX_PLATFORMS="cpu")
  (results_file,) = tmp_path.glob("scaling_*.json")
  rows = json.loads(results_file.read_text())["rows"]
  strategies = {(r["model"], r["devices"], r["strategy"]) for r in rows}
  assert ("balanced", 2, "mem_opt") in strategies
  for row in rows:
    if row["devices"] == 2 and row["strategy"] != "sgd":
      # Two devices share the decompositions (the smoke layers are balanced
      # to within one layer).
      assert row["decomposition_share"] < 0.75, row


def test_convergence_refuses_a_center_outside_the_swept_range():
  for center, message in (
    ("kfac_adaptive=2000", r"within \[0.0001, 1000\]"),
    ("kfac_adaptive=0", "must be > 0"),
    ("adam=-1e-3", "must be > 0"),
  ):
    result = subprocess.run(
      [
        sys.executable,
        "-m",
        "benchmarks.convergence",
        "--center",
        center,
        "--tasks",
        "cifar",
        "--smoke",
      ],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=120,
    )
    assert result.returncode != 0
    assert re.search(message, result.stderr), result.stderr[-1000:]


def run_convergence(*args: str) -> subprocess.CompletedProcess[str]:
  result = subprocess.run(
    [sys.executable, "-m", "benchmarks.convergence", "--no-progress", *args],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  return result


def test_convergence_smoke_and_resume(tmp_path):
  asked = ("sgd", "kron", "kfac", "kfac_adaptive")
  # kron races only where distributed-kron is installed; else it is left out.
  has_kron = importlib.util.find_spec("distributed_kron") is not None
  optimizers = tuple(n for n in asked if has_kron or n != "kron")
  # kfac_adaptive's factors from the Gauss-Newton surrogate on 4 examples.
  first = run_convergence(
    "--smoke",
    "--tasks",
    "cifar",
    "--optimizers",
    *asked,
    "--curvature",
    "gauss-newton",
    "--curvature-examples",
    "4",
    "--targets",
    "0",
    "101",
    "--at-seconds",
    "0",
    "--out",
    str(tmp_path / "first"),
  )
  (path,) = (tmp_path / "first").glob("convergence_*.json")
  runs = json.loads(path.read_text())["runs"]
  assert [r["optimizer"] for r in runs] == list(optimizers)
  for run in runs:
    assert run["steps"] == 2 and not run["diverged"]
    assert [p["step"] for p in run["curve"]] == [0, 2]
    assert all(0 <= p["metric"] <= 100 for p in run["curve"])
  # The target is the best first-order final accuracy (one seed: its value);
  # K-FAC reaches it iff one of its evaluations is at least as high.
  target = max(
    r["final"] for r in runs if r["optimizer"] not in ("kfac", "kfac_adaptive")
  )
  kfac_run = next(r for r in runs if r["optimizer"] == "kfac")
  reached = any(p["metric"] >= target for p in kfac_run["curve"])
  (table,) = (tmp_path / "first").glob("convergence_*.md")
  kfac_row = next(
    line
    for line in table.read_text().splitlines()
    if line.startswith("| kfac |")
  )
  assert ("| 1/1 |" if reached else "| 0/1 |") in kfac_row
  # Readouts: accuracy ≥ 0 from the first evaluation, 101 % never.
  readout = next(
    line
    for line in table.read_text().splitlines()
    if line.startswith("| kfac, seed 0 |")
  )
  initial = kfac_run["curve"][0]["metric"]
  assert readout.startswith(
    f"| kfac, seed 0 | 0 (0) | 0, 0.0 | never | — | {initial:.4g} | "
  ), readout
  # The adaptive mode has no learning rate: its swept setting is λ₀ (here
  # unswept, at the center: kfac-jax's example's 150).
  assert "| kfac_adaptive | λ₀=150 |" in table.read_text()
  assert "damping=150.0" in runs[-1]["description"]
  assert "curvature 'gauss-newton'" in runs[-1]["description"]
  # Its λ, α, μ, ρ after each step: at the first step δ = 0, so μ = 0.
  trace = runs[-1]["trace"]
  assert sorted(trace) == ["alpha", "damping", "mu", "rho"]
  assert all(len(values) == 2 for values in trace.values())
  assert trace["mu"][0] == 0 and trace["alpha"][0] != 0
  floor = kfac_jax.AdaptiveConfig().min_damping
  assert runs[-1]["min_damping"] == floor
  first_order = len(optimizers) - 2
  assert [r.get("inv_dtype") for r in runs] == (
    [None] * first_order + ["float32", "float32"]
  )
  assert all(floor <= d <= 1000 for d in trace["damping"])
  assert all("trace" not in r for r in runs[:-1])
  assert list((tmp_path / "first").glob("convergence_*_cifar.png"))
  assert "after 2 steps" in first.stdout
  assert has_kron or "leaving kron out" in first.stdout

  # A resumed race takes every run from the JSON, except the K-FAC ones
  # under another --inv-dtype, and kfac_adaptive's under another
  # --curvature (here the default, factor_batch_size=4) and another floor
  # of λ.
  second = run_convergence(
    "--smoke",
    "--tasks",
    "cifar",
    "--optimizers",
    *optimizers,
    "--curvature-examples",
    "4",
    "--min-damping",
    "1e-3",
    "--inv-dtype",
    "bfloat16",
    "--resume",
    str(path),
    "--out",
    str(tmp_path / "second"),
  )
  retrained = [
    line.split()[2]
    for line in second.stdout.splitlines()
    if "after 2 steps" in line
  ]
  assert retrained == ["kfac", "kfac_adaptive"]
  (path2,) = (tmp_path / "second").glob("convergence_*.json")
  runs2 = json.loads(path2.read_text())["runs"]
  assert runs2[:first_order] == runs[:first_order]
  for run in runs2[first_order:]:
    assert run["inv_dtype"] == "bfloat16"
    assert "inv_dtype=dtype(bfloat16)" in run["description"]
  assert runs2[-1]["curvature"] == ["subset", 4]
  assert "factor_batch_size=4" in runs2[-1]["description"]
  assert runs2[-1]["min_damping"] == 1e-3
  assert "min_damping=0.001" in runs2[-1]["description"]


def test_time_to_target_readouts():
  """The interpolated crossing, the metric at a time, and medians over seeds
  that count a miss as infinitely late."""
  task = toy_task()
  run = dict(
    curve=[
      dict(step=s, seconds=t, metric=m)
      for s, t, m in [(0, 0.0, 10.0), (10, 5.0, 8.0), (20, 10.0, 6.0)]
    ]
  )
  assert targets.first_reach(task, run, 7.0) == (20, 10.0)
  assert targets.crossing(task, run, 7.0) == (15.0, 7.5)
  assert targets.crossing(task, run, 10.0) == (0.0, 0.0)
  assert targets.crossing(task, run, 5.0) is None
  assert targets.metric_at(run, 9.9) == 8.0
  assert targets.metric_at(run, 10.0) == 6.0
  assert targets.median_reach([(4, 40.0), None, (2, 20.0)], 1) == 40.0
  assert targets.median_reach([(4, 40.0), None, None], 1) is None


def test_curvature_shared_loss_is_the_same_objective():
  """Split at the curvature examples, a mean loss plus a regulariser keeps
  its value and gradient (against the loss on the whole batch), every array
  of the batch is cut at the same example, and a batch no larger than the
  curvature examples is passed whole."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from tests import reference  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  x = rng.normal(size=(12, 3)).astype(np.float32)
  y = rng.normal(size=(12, 2)).astype(np.float32)
  weights = rng.normal(size=(3, 2)).astype(np.float32)

  def loss_fn(w, x, y):
    return ((x @ w - y) ** 2).sum(-1).mean() + 0.1 * (w**2).sum()

  for examples in (1, 5, 11, 12, 40):
    split = training.curvature_shared_loss(loss_fn, examples)
    value, grad = jax.value_and_grad(split)(weights, x, y)
    expected_value, expected_grad = jax.value_and_grad(loss_fn)(weights, x, y)
    # The dot of 3, −y, the square, the sum over 2, the mean over 12, the
    # regulariser's sum over 6 and the split's two parts added
    # (reference.assert_float32_close's ``terms``); the gradient, backward
    # and the sum over the 12 examples.
    forward = 3 + 2 + 2 + 12 + 6 + 2
    reference.assert_float32_close(value, expected_value, terms=forward)
    reference.assert_float32_close(grad, expected_grad, terms=2 * forward + 12)
  # Were y cut elsewhere than x (or the head weighed by anything but
  # its share), a per-example loss would change.
  calls = []
  training.curvature_shared_loss(
    lambda w, x, y: calls.append((x.shape, y.shape)) or 0.0, 5
  )(weights, x, y)
  assert calls == [((5, 3), (5, 2)), ((7, 3), (7, 2))]


def test_deepmind_scripts_refuse_this_kfac_jax(tmp_path):
  """They need DeepMind's kfac-jax (own venv, not in CI): under this one they
  import, parse their flags and stop with the message that says so."""
  for module in ("dm_kfac_step_time", "dm_kfac_race"):
    result = subprocess.run(
      [
        sys.executable,
        "-m",
        f"benchmarks.{module}",
        "--out",
        str(tmp_path / "x.json"),
      ],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=240,
    )
    assert result.returncode != 0
    assert "is not DeepMind's kfac-jax" in result.stderr, result.stderr[-2000:]


def test_phases_smoke(tmp_path):
  """Every program is timed, and the table shows each phase beside AdamW's
  step (the smoke's numbers are one call each: no timing is asserted)."""
  from benchmarks import phases, phases_report  # pylint: disable=g-import-not-at-top

  result = run_smoke("phases", tmp_path)
  (path,) = tmp_path.glob("phases_*.json")
  (task,) = json.loads(path.read_text())["tasks"]
  programs = {
    "adamw",
    "grad",
    "capture",
    *(name for name, *_ in phases.KFAC_PROGRAMS),
  }
  assert set(task["median_ms"]) == programs
  assert all(ms > 0 for ms in task["median_ms"].values())
  assert task["largest_factor"]["size"] == 257  # the MLP's 256 + bias
  for label, _ in phases_report.ROWS:
    assert f"| {label} |" in result.stdout


def test_ablation_smoke(tmp_path):
  """The ablation trains a variant as the race trains kfac_levers (its
  statistics-free steps included) and reports its curve; a variant the
  task's layers refuse is reported by its message, the others run."""
  result = run_smoke(
    "ablation",
    tmp_path,
    "--task",
    "mnist_bn",
    "--variants",
    "ekfac",
    "levers",
  )
  (path,) = tmp_path.glob("ablation_*.json")
  (run,) = json.loads(path.read_text())["runs"]
  assert run["variant"] == "levers" and run["steps"] == 2
  assert "factor_update_steps=10" in run["description"]
  assert "| ekfac | refused: " in result.stdout
  assert "eigenvalue_correction=True" in result.stdout


def test_phases_report_arithmetic():
  """The phases and amortized steps from made-up medians, by hand."""
  from benchmarks import phases_report  # pylint: disable=g-import-not-at-top

  ms = dict(
    adamw=10.0,
    grad=8.0,
    capture=11.0,
    stats=20.0,
    no_stats=12.0,
    decompose=52.0,
    full=62.0,
    eigen_no_stats=14.0,
    eigen_decompose=94.0,
    fraction_stats=16.0,
    reduce_stats=15.0,
    both_stats=13.0,
    levers_no_stats=9.0,
    levers_full=30.0,
  )
  out = phases_report.derived(ms, period=10)
  assert out["adamw_update"] == 2.0 and out["statistics"] == 3.0
  assert out["factor_update"] == 20.0 - 12.0 - 3.0
  assert out["preconditioning"] == 4.0 and out["decomposition"] == 40.0
  assert out["eigen_decomposition"] == 80.0
  assert out["amortized"] == (9 * 20.0 + 62.0) / 10
  assert out["amortized_no_stats"] == (9 * 12.0 + 62.0) / 10
  # The factor step with both levers: 62 − (20 − 13).
  assert out["amortized_all_levers"] == (9 * 12.0 + 55.0) / 10
  assert out["amortized_levers"] == (9 * 9.0 + 30.0) / 10


def test_batch_norm_state_is_threaded_through_every_contestant():
  """One step of each contestant on a BatchNorm task (the race's MNIST CNN
  on 8x8 random images, so that its layers are small) returns BatchNorm's
  running statistics updated by the step's batch: those of the loss's
  forward pass at the initial parameters, and for the first BatchNorm the
  convolution's batch mean computed here by hand (0.9·0 + 0.1·mean)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from benchmarks import race_optimizers  # pylint: disable=g-import-not-at-top
  from examples import datasets  # pylint: disable=g-import-not-at-top
  from tests import reference  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, 8, 8, 1)).astype(np.float32)
  y = rng.integers(0, 10, size=8).astype(np.int32)
  task = tasks.batch_norm_classifier(
    "mnist_bn",
    "tiny",
    models.BatchNormCNN(),
    datasets.ImageData("random", x, y, x, y, 10),
    None,
    8,
    weight_decay=0.0,
  )
  assert task.stateful and race_optimizers.unsupported("kfac_adaptive", task)
  params, state = task.initial(0)
  expected = jax.device_get(task.loss_fn(params, state, x, y)[1])
  conv = params["Conv_0"]
  features = (
    jax.lax.conv_general_dilated(
      x,
      conv["kernel"],
      (1, 1),
      "SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    + conv["bias"]
  )
  by_hand = 0.1 * np.asarray(features, np.float64).mean(axis=(0, 1, 2))
  # Roundings: the convolutions' sums (9 and 3·3·32 products) and the
  # means and variances over the positions (8·8·8 and 8·4·4), added.
  terms = 9 + 2 * 8 * 8 * 8 + 288 + 2 * 8 * 4 * 4
  # Kron's step is the first-order path AdamW's takes (and the slowest
  # to compile).
  for name in ("adamw", "muon", "soap", "kfac"):
    optimizer = race_optimizers.build_optimizer(
      name, race_optimizers.CENTERS[name], task
    )
    step = training.make_train_step(task.loss_fn, optimizer, stateful=True)
    fresh = jax.tree.map(np.array, (params, state))
    _, _, new_state, loss = step(
      fresh[0], optimizer.tx.init(fresh[0]), fresh[1], jax.random.key(0), x, y
    )
    assert np.isfinite(float(loss)), name
    for got, want in zip(jax.tree.leaves(new_state), jax.tree.leaves(expected)):
      reference.assert_float32_close(got, want, terms=terms, err_msg=name)
    reference.assert_float32_close(
      new_state["BatchNorm_0"]["mean"], by_hand, terms=terms, err_msg=name
    )


def test_muon_orthogonalizes_the_kernels_of_the_layer_table():
  """Muon's dimension numbers: a scanned DenseGeneral kernel reduces its
  input axis and outputs its heads × head_dim, the stack axis batched; the
  embedding, biases and norms go to Muon's Adam."""
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  import pytest  # pylint: disable=g-import-not-at-top

  from benchmarks import race_optimizers  # pylint: disable=g-import-not-at-top

  if not hasattr(optax.contrib, "MuonDimensionNumbers"):
    pytest.skip(
      "optax < 0.2.7: Muon takes the 2-D parameters only (race_optimizers.muon)"
    )
  task = tasks.shakespeare_task(eval_examples=8, batch_size=2)
  params = task.init(0)
  dims = race_optimizers.muon_dimensions(task.layers)(params)
  query = dims["blocks"]["attention"]["query"]
  assert params["blocks"]["attention"]["query"]["kernel"].shape == (
    2,
    64,
    4,
    16,
  )
  assert tuple(query["kernel"]) == ((1,), (2, 3))
  assert query["bias"] is None
  out = dims["blocks"]["attention"]["out"]["kernel"]
  assert tuple(out) == ((1, 2), (3,))
  assert tuple(dims["logits"]["kernel"]) == ((0,), (1,))
  assert dims["Embed_0"]["embedding"] is None and dims["position"] is None
  muon = sum(
    d is not None
    for d in jax.tree.leaves(
      dims, is_leaf=lambda d: d is None or isinstance(d, tuple)
    )
  )
  assert muon == 7  # q, k, v, out, mlp_in, mlp_out, logits


def test_convergence_smoke_on_a_batch_norm_task(tmp_path):
  """The race trains and evaluates a BatchNorm task with every contestant
  that can, and says which it leaves out; its clock may count CPU
  seconds."""
  result = run_convergence(
    "--smoke",
    "--tasks",
    "mnist_bn",
    "--optimizers",
    "adamw",
    "kfac",
    "kfac_adaptive",
    "kfac_levers",
    "kfac_levers_kl",
    "kfac_levers_adamw",
    "--center",
    "kfac_levers_kl=0.3",
    "--clock",
    "cpu",
    "--out",
    str(tmp_path),
  )
  assert "leaving kfac_adaptive out" in result.stdout
  (path,) = tmp_path.glob("convergence_*.json")
  runs = json.loads(path.read_text())["runs"]
  # kfac_levers' second step is its program without statistics.
  assert [r["optimizer"] for r in runs] == [
    "adamw",
    "kfac",
    "kfac_levers",
    "kfac_levers_kl",
    "kfac_levers_adamw",
  ]
  for run in runs[-3:]:
    assert "NO_STATS between factor steps" in run["description"]
  # kfac_levers_kl's swept value is the KL clip, at the levers' rate.
  assert "kfac(lr=0.1," in runs[-2]["description"]
  assert "kl_clip=0.3" in runs[-2]["description"]
  assert "optax.adamw(0.001) on the other params" in runs[-1]["description"]
  for run in runs:
    assert run["steps"] == 2 and not run["diverged"] and run["clock"] == "cpu"
    assert all(0 <= p["metric"] <= 100 for p in run["curve"])
