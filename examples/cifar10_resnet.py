"""CIFAR-10 ResNet with BatchNorm: K-FAC vs SGD with momentum vs AdamW.

A ResNet-20 (or 32, ``--depth``; 3x3 convolutions without bias, BatchNorm,
ReLU, 16/32/64 channels, 1x1 projection shortcuts) is trained on the
CIFAR-10 subset (10,000 training / 1,000 test images, random crops and flips)
by each optimizer from the same initialization on the same mini-batches. The
script prints a table (test accuracy, final training loss, time) and writes
the loss curves to ``<out>/cifar10_resnet.png``.

K-FAC preconditions every convolution and the classifier; BatchNorm's scale
and bias are not Kronecker layers and pass through to the SGD that follows.

Run from the repository root::

  python examples/cifar10_resnet.py               # defaults, ~25 min on 2 cores
  python examples/cifar10_resnet.py --steps 20    # smoke run
  python examples/cifar10_resnet.py --help

Without the CIFAR-10 files (``../shared/data/cifar10`` or ``$KFAC_JAX_DATA``)
it trains on scikit-learn's 8x8 digits instead, and says so.
"""

from __future__ import annotations

import functools
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import flax.linen as nn  # pylint: disable=g-import-not-at-top
import jax
import jax.numpy as jnp
import numpy as np
import optax

import common  # pylint: disable=g-import-not-at-top
import datasets  # pylint: disable=g-import-not-at-top

# Defaults sized for 2 CPU cores, where one SGD step of ResNet-20 at batch 128
# takes ~2 s: 3 epochs (234 steps). The factors of the 32x32 stage (131,072
# patch rows per layer) cost more than the forward/backward pass, so they are
# refreshed every 10 steps, as KAISA does for its ResNets; inverses too.
DEFAULTS = dict(
    epochs=3,
    batch_size=128,
    kfac_lr=0.1,
    sgd_lr=0.1,
    adam_lr=1e-3,
    compute_method="inverse",
    damping=0.3,
    kl_clip=1e-3,
    inv_update_steps=10,
    factor_update_steps=10,
    factor_decay=0.95,
    optimizers="kfac,sgd,adamw",
    weight_decay=1e-4,
)


class ResidualBlock(nn.Module):
  """conv3x3-BN-ReLU-conv3x3-BN, plus the (projected) input, then ReLU."""

  features: int
  strides: int

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    norm = functools.partial(nn.BatchNorm, use_running_average=not train,
                             momentum=0.9)
    h = nn.Conv(self.features, (3, 3), self.strides, use_bias=False)(x)
    h = nn.relu(norm()(h))
    h = nn.Conv(self.features, (3, 3), use_bias=False)(h)
    h = norm()(h)
    if self.strides != 1 or x.shape[-1] != self.features:
      x = nn.Conv(self.features, (1, 1), self.strides, use_bias=False,
                  name="projection")(x)
      x = norm()(x)
    return nn.relu(h + x)


class ResNet(nn.Module):
  """ResNet-(6n+2) for small images (He et al. 2016, section 4.2)."""

  depth: int = 20
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
    blocks_per_stage = (self.depth - 2) // 6
    x = nn.Conv(16, (3, 3), use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    for stage, features in enumerate((16, 32, 64)):
      for block in range(blocks_per_stage):
        strides = 2 if stage > 0 and block == 0 else 1
        x = ResidualBlock(features, strides)(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


def augment(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """Random 4-pixel-padded crops and horizontal flips (32x32 images only)."""
  if images.shape[1] < 32:
    return images
  n, h, w, _ = images.shape
  padded = np.pad(images, ((0, 0), (4, 4), (4, 4), (0, 0)), mode="reflect")
  dy, dx = rng.integers(0, 9, size=(2, n))
  rows = dy[:, None] + np.arange(h)
  cols = dx[:, None] + np.arange(w)
  out = padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]
  flip = rng.random(n) < 0.5
  out[flip] = out[flip, :, ::-1]
  return out


def main(argv: list[str] | None = None) -> int:
  parser = common.base_parser(__doc__.split("\n\n")[0], **DEFAULTS)
  parser.add_argument("--depth", type=int, default=20, choices=(20, 32),
                      help="ResNet depth")
  args = parser.parse_args(argv)
  common.check_args(args)

  data = datasets.load_image_classification()
  model = ResNet(depth=args.depth, num_classes=data.num_classes)
  variables = model.init(jax.random.key(args.seed), data.x_train[:1])
  params, batch_stats = variables["params"], variables["batch_stats"]

  def loss_fn(params, batch_stats, x, y):
    logits, updates = model.apply({"params": params, "batch_stats": batch_stats},
                                  x, mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, updates["batch_stats"]

  @jax.jit
  def per_example(params, batch_stats, x, y):
    logits = model.apply({"params": params, "batch_stats": batch_stats}, x,
                         train=False)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return losses, (jnp.argmax(logits, -1) == y).astype(jnp.float32)

  # One augmented copy of the training set per epoch, made up front.
  rng = np.random.default_rng(args.seed)
  x_train = np.concatenate([augment(data.x_train, rng)
                            for _ in range(args.epochs)])
  y_train = np.tile(data.y_train, args.epochs)
  optimizers = common.build_optimizers(args)
  steps = common.num_steps(len(x_train), args.batch_size, 1, args.steps)
  print(f"{data.name}, ResNet-{args.depth}: {args.epochs} epoch(s) capped at "
        f"{steps} steps of batch {args.batch_size}; "
        f"{common.describe_setup()}", flush=True)

  results = common.compare(
      optimizers, loss_fn, params, (x_train, y_train),
      batch_size=args.batch_size, epochs=1, max_steps=args.steps,
      seed=args.seed, desc=f"ResNet-{args.depth}", model_state=batch_stats)

  train_eval = common.head((data.x_train, data.y_train), args.eval_size)
  test_eval = common.head((data.x_test, data.y_test), args.eval_size)
  columns = common.classification_columns(
      results, lambda r, x, y: per_example(r.params, r.model_state, x, y),
      train_eval, test_eval)
  common.report(
      results, optimizers, columns, args.out, "cifar10_resnet",
      header=(f"{data.name}, ResNet-{args.depth} with BatchNorm, {steps} steps "
              f"of batch {args.batch_size}, seed {args.seed}. Train loss and "
              f"accuracy over {len(train_eval[0]):,} un-augmented training "
              f"images after the last step; test accuracy over "
              f"{len(test_eval[0]):,} test images; times exclude "
              "compilation."),
      plot_title=f"ResNet-{args.depth}, {data.name}, batch {args.batch_size}",
      ylabel="train cross-entropy (mini-batch)", log_y=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
