"""The timed variants of ``step_time.py``: configurations, optimizers, steps.

A ``Config`` is one (model, batch) of random data; ``make_contestant`` builds
one variant's jitted step on it (``bench_common.Contestant``), from the
working tree's ``kfac_jax`` or from a committed revision
(``load_kfac_revision``, ``--kfac-revs``).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import math
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import kfac_jax
from benchmarks import bench_common
from benchmarks.race_optimizers import CENTERS, KFAC_ADAPTIVE_SETTINGS
from examples import models

REPO = pathlib.Path(__file__).resolve().parent.parent


def load_kfac_revision(rev: str) -> tuple[str, Any]:
  """``(commit, module)``: kfac_jax as of git revision ``rev``.

  ``git archive`` copies the package into a temporary directory as
  ``kfac_jax_<commit>`` (its own imports renamed), so it imports beside the
  working tree's ``kfac_jax`` in one process.
  """
  git = lambda *a: (
    subprocess.run(
      ["git", *a], cwd=REPO, capture_output=True, check=True
    ).stdout
  )
  commit = git("rev-parse", "--short", rev).decode().strip()
  name = f"kfac_jax_{commit}"
  root = pathlib.Path(tempfile.mkdtemp(prefix="kfac_rev_"))
  with tarfile.open(
    fileobj=io.BytesIO(git("archive", commit, "kfac_jax")), mode="r"
  ) as archive:
    # (Our own repository's archive; the filter exists from Python 3.11.4.)
    archive.extractall(
      root, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {})
    )
  (root / "kfac_jax").rename(root / name)
  for source in (root / name).rglob("*.py"):
    source.write_text(re.sub(r"\bkfac_jax\b", name, source.read_text()))
  spec = importlib.util.spec_from_file_location(
    name,
    root / name / "__init__.py",
    submodule_search_locations=[str(root / name)],
  )
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # its own imports of ``name`` find it
  spec.loader.exec_module(module)
  return commit, module


def kfac_method(variant: str) -> str:
  """``eigen``, ``inverse`` or ``adaptive``: ``kfac-<method>[-gfs][@<rev>]``."""
  return variant.split("@")[0].split("-")[1]


def from_stats(variant: str) -> bool:
  """Whether a K-FAC variant uses ``gradient_from_stats`` (``-gfs``)."""
  return variant.split("@")[0].endswith("-gfs")


# "-subspace": the eigen method with eigen_solver="subspace"; "-ekfac": that
# and eigenvalue_correction=True.
EIGEN_OPTIONS = {
  "subspace": dict(eigen_solver="subspace"),
  "ekfac": dict(eigen_solver="subspace", eigenvalue_correction=True),
}


def eigen_options(variant: str) -> dict[str, Any]:
  """``scale_by_kfac`` settings of a ``-subspace``/``-ekfac`` variant, or {}."""
  return EIGEN_OPTIONS.get(variant.split("@")[0].split("-")[-1], {})


def make_tx(
  variant: str, args: argparse.Namespace, batch: int, lib: Any = kfac_jax
) -> optax.GradientTransformation:
  lr = args.learning_rate
  if variant == "sgd":
    return optax.sgd(lr, momentum=0.9)
  if variant == "adamw":
    return optax.adamw(1e-3, weight_decay=1e-4)
  method = kfac_method(variant)
  if method == "adaptive":
    settings = dict(
      KFAC_ADAPTIVE_SETTINGS,
      damping=CENTERS["kfac_adaptive"],
      inv_update_steps=args.inv_update_steps,
      factor_batch_size=curvature_examples(batch),
    )
    return lib.scale_by_kfac(
      adaptive=lib.AdaptiveConfig(
        damping_adaptation_interval=args.inv_update_steps
      ),
      **settings,
    )
  # Only where asked, so that --kfac-revs can time commits before the option.
  extra = dict(gradient_from_stats=True) if from_stats(variant) else {}
  extra.update(eigen_options(variant))
  return optax.chain(
    lib.scale_by_kfac(
      learning_rate=lr,
      damping=args.damping,
      factor_decay=0.95,
      kl_clip=1e-3,
      factor_update_steps=1,
      inv_update_steps=args.inv_update_steps,
      compute_method=method,
      **extra,
    ),
    optax.sgd(lr, momentum=0.9),
  )


def is_kfac(variant: str) -> bool:
  return variant.startswith("kfac")


def curvature_examples(batch: int) -> int:
  """``kfac-adaptive``'s curvature mini-batch: a quarter of the batch (the
  race's 250 of 1000)."""
  return max(1, batch // 4)


def kfac_count(opt_state: Any) -> int:
  """The step count of a K-FAC state, alone (adaptive) or first in a chain."""
  alone = "count" in getattr(opt_state, "_fields", ())  # a chain's is a tuple
  kfac_state = opt_state if alone else opt_state[0]
  return int(kfac_state.count)


class Config:
  """One (model, batch) configuration: params, data, loss and FLOP shapes."""

  name: str
  batch: int
  params: Any
  extra_state: Any  # threaded through the step (BatchNorm stats) or None
  data: tuple[jax.Array, ...]
  loss_fn: Callable[..., Any]  # (params, extra_state, *data) -> (loss, extra)
  # (lib, *data) -> lib.SplitLoss on the curvature examples, or None.
  split_loss: Callable[..., Any] | None
  description: str


def autoencoder_config(batch: int, args: argparse.Namespace) -> Config:
  widths = (
    bench_common.SMOKE_AUTOENCODER_WIDTHS
    if args.smoke
    else models.AUTOENCODER_WIDTHS
  )
  pixels = bench_common.SMOKE_PIXELS if args.smoke else models.MNIST_PIXELS
  model = models.Autoencoder(widths, out_features=pixels)
  key_data, key_init = jax.random.split(jax.random.PRNGKey(args.seed))
  x = bench_common.random_images(key_data, batch, pixels)
  c = Config()
  c.name = "autoencoder"
  c.batch = batch
  c.params = model.init(key_init, x[:1])["params"]
  c.extra_state = None
  c.data = (x,)
  c.description = "-".join(map(str, (pixels, *widths, pixels))) + ", float32"

  def loss_fn(params, extra, x):
    logits = model.apply({"params": params}, x)
    return models.autoencoder_losses(logits, x).mean(), extra

  def split_loss(lib, x):
    curvature = x[: curvature_examples(len(x))]
    return lib.SplitLoss(
      outputs_fn=lambda params: model.apply({"params": params}, curvature),
      loss_fn=lambda logits: models.autoencoder_losses(
        logits, curvature
      ).mean(),
    )

  c.loss_fn = loss_fn
  c.split_loss = split_loss
  return c


def resnet_config(args: argparse.Namespace) -> Config:
  size = 8 if args.smoke else 32
  model = models.CifarResNet(
    depth=args.resnet_depth, width=args.resnet_width, batch_norm=args.batch_norm
  )
  key_x, key_y, key_init = jax.random.split(jax.random.PRNGKey(args.seed), 3)
  images = jax.random.normal(key_x, (args.resnet_batch, size, size, 3))
  labels = jax.random.randint(key_y, (args.resnet_batch,), 0, 10)
  variables = model.init(key_init, images[:1], train=False)
  c = Config()
  c.name = f"resnet{args.resnet_depth}"
  c.batch = args.resnet_batch
  c.params = variables["params"]
  c.extra_state = variables.get("batch_stats", {})
  c.data = (images, labels)
  c.description = (
    f"CIFAR ResNet-{args.resnet_depth}, width {args.resnet_width}"
    f", {'BatchNorm' if args.batch_norm else 'no BatchNorm'}, "
    f"{size}x{size}x3, float32"
  )
  c.loss_fn = models.resnet_loss_fn(model)
  c.split_loss = None  # BatchNorm's state: no SplitLoss, no adaptive mode
  return c


def make_contestant(
  variant: str, config: Config, args: argparse.Namespace, lib: Any = kfac_jax
) -> bench_common.Contestant:
  """``lib``: the kfac_jax module to time (``load_kfac_revision``)."""
  tx = make_tx(variant, args, config.batch, lib)
  # Each contestant gets its own copies: its step donates them.
  params, extra_state = (
    jax.tree.map(jnp.copy, t) for t in (config.params, config.extra_state)
  )
  opt_state = tx.init(params)
  loss_fn = config.loss_fn

  if is_kfac(variant):

    def step(params, extra, opt_state, *data):
      (loss, extra), grads, stats = lib.value_grad_and_stats(
        loss_fn, has_aux=True
      )(params, extra, *data)
      adaptive = (
        dict(split_loss=config.split_loss(lib, *data))
        if kfac_method(variant) == "adaptive"
        else {}
      )
      updates, opt_state = tx.update(
        grads, opt_state, params, kfac_stats=stats, **adaptive
      )
      return optax.apply_updates(params, updates), extra, opt_state, loss
  else:

    def step(params, extra, opt_state, *data):
      (loss, extra), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, extra, *data
      )
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), extra, opt_state, loss

  # Params and states are donated (as DeepMind's kfac-jax does), so that
  # what a step leaves unchanged (K-FAC's preconditioners off decomposition
  # steps) is not copied.
  jitted = jax.jit(step, donate_argnums=(0, 1, 2))
  data = config.data

  def call(carry):
    params, extra, opt_state, _ = carry
    return jitted(params, extra, opt_state, *data)

  return bench_common.Contestant(
    name=variant,
    step=call,
    carry=(params, extra_state, opt_state, jnp.zeros([])),
    inv_update_steps=args.inv_update_steps if is_kfac(variant) else None,
    read_count=(lambda carry: kfac_count(carry[2]))
    if is_kfac(variant)
    else None,
    state_bytes=bench_common.tree_nbytes(opt_state),
    lower=lambda: jitted.lower(params, extra_state, opt_state, *data),
  )


def layer_shapes(config: Config) -> list[dict[str, int]]:
  """Rows, fan-in (kh·kw·cin), fan-out and bias of every Dense/Conv layer.

  Shapes only: ``jax.eval_shape`` of the capture gives each layer's output
  cotangent shape (rows = batch · output positions), the params give the
  kernel shape. In call order: the first layer is the one applied to the
  data.
  """

  def loss_only(params, extra, *data):
    return config.loss_fn(params, extra, *data)

  _, _, stats = jax.eval_shape(
    kfac_jax.value_grad_and_stats(loss_only, has_aux=True),
    config.params,
    config.extra_state,
    *config.data,
  )
  shapes = []
  for name, s in stats.items():
    node = config.params
    for key in name.split("/"):
      node = node[key]
    kernel = node["kernel"].shape
    rows = sum(math.prod(g.shape[:-1]) for g in s.output_cotangents)
    shapes.append(
      dict(
        name=name,
        rows=int(rows),
        fan_in=int(math.prod(kernel[:-1])),
        fan_out=int(kernel[-1]),
        bias=int(s.signature.has_bias),
        conv=int(s.signature.conv is not None),
      )
    )
  return shapes
