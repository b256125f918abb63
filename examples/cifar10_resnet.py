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

  python -m examples.cifar10_resnet               # defaults, ~25 min on 2 cores
  python -m examples.cifar10_resnet --steps 20    # smoke run
  python -m examples.cifar10_resnet --help

Without the CIFAR-10 files (``../shared/data/cifar10`` or ``$KFAC_JAX_DATA``)
it trains on scikit-learn's 8x8 digits instead, and says so.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples import (
  datasets,
  flags,
  mnist_classifier,
  models,
  reporting,
  training,
)

# Defaults sized for 2 CPU cores, where one SGD step of ResNet-20 at batch 128
# takes ~2 s: 3 epochs (234 steps). The factors of the 32x32 stage (131,072
# patch rows per layer) cost more than the forward/backward pass, so they are
# refreshed every 10 steps, as KAISA does for its ResNets; inverses too.
# K-FAC: the BatchNorm CNN recipe of the configuration guide (lr 0.1,
# kl_clip 0.1).
DEFAULTS = dict(
  mnist_classifier.DEFAULTS,
  epochs=3,
  batch_size=128,
  kfac_lr=0.1,
  kl_clip=0.1,
  factor_update_steps=10,
  optimizers="kfac,sgd,adamw",
  weight_decay=1e-4,
)


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
  parser = flags.base_parser(__doc__.split("\n\n")[0], **DEFAULTS)
  parser.add_argument(
    "--depth", type=int, default=20, choices=(20, 32), help="ResNet depth"
  )
  args = parser.parse_args(argv)
  flags.check_args(args)

  data = datasets.load_image_classification()
  model = models.CifarResNet(depth=args.depth, num_classes=data.num_classes)
  variables = model.init(jax.random.key(args.seed), data.x_train[:1])
  params, batch_stats = variables["params"], variables["batch_stats"]

  loss_fn = models.resnet_loss_fn(model)

  @jax.jit
  def per_example(params, batch_stats, x, y):
    logits = model.apply(
      {"params": params, "batch_stats": batch_stats}, x, train=False
    )
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return losses, (jnp.argmax(logits, -1) == y).astype(jnp.float32)

  # One augmented copy of the training set per epoch, made up front.
  rng = np.random.default_rng(args.seed)
  x_train = np.concatenate(
    [augment(data.x_train, rng) for _ in range(args.epochs)]
  )
  y_train = np.tile(data.y_train, args.epochs)
  optimizers = flags.build_optimizers(args)
  steps = training.num_steps(len(x_train), args.batch_size, 1, args.steps)
  print(
    f"{data.name}, ResNet-{args.depth}: {args.epochs} epoch(s) capped at "
    f"{steps} steps of batch {args.batch_size}; "
    f"{flags.describe_setup()}",
    flush=True,
  )

  results = training.compare(
    optimizers,
    lambda opt: training.make_train_step(loss_fn, opt, stateful=True),
    params,
    (x_train, y_train),
    batch_size=args.batch_size,
    epochs=1,
    max_steps=args.steps,
    seed=args.seed,
    desc=f"ResNet-{args.depth}",
    model_state=batch_stats,
  )

  train_eval = flags.head((data.x_train, data.y_train), args.eval_size)
  test_eval = flags.head((data.x_test, data.y_test), args.eval_size)
  columns = reporting.classification_columns(
    results,
    lambda r, x, y: per_example(r.params, r.model_state, x, y),
    train_eval,
    test_eval,
  )
  reporting.report(
    results,
    optimizers,
    columns,
    args.out,
    "cifar10_resnet",
    header=(
      f"{data.name}, ResNet-{args.depth} with BatchNorm, {steps} steps "
      f"of batch {args.batch_size}, seed {args.seed}. Train loss and "
      f"accuracy over {len(train_eval[0]):,} un-augmented training "
      f"images after the last step; test accuracy over "
      f"{len(test_eval[0]):,} test images; times exclude "
      "compilation."
    ),
    plot_title=f"ResNet-{args.depth}, {data.name}, batch {args.batch_size}",
    ylabel="train cross-entropy (mini-batch)",
    log_y=True,
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
