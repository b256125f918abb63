"""Capture from a loss that merges an ``nnx.State`` into its model.

Flax's functional idiom differentiates the params' ``nnx.State`` and builds
the model inside the loss::

  graphdef, params = nnx.split(model, nnx.Param)

  def loss_fn(params, x, y):
    model = nnx.merge(graphdef, params)
    ...

The model form of the NNX capture (``flax_nnx``) switches the classes of a
private copy of the model it is given; here the model is made by the loss, out
of reach. Two things reach into it unchanged: the ``Variable`` objects of the
State (``nnx.merge`` reuses them, and lifted transforms carry their metadata
to the copies they make), and the methods of the Flax classes. So the capture
hands the loss a copy of the State whose every ``Variable`` carries a
``Tag`` in its metadata, and while it traces the loss it routes the calls of
``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Conv`` and ``nnx.Embed``
(``__call__``, and ``Embed.attend``) through ``routed``: a call whose
kernel carries a tag goes to the tag's ``route``, every other call to the
Flax method as it was.

Each ``Tag`` is a new object per pass (compared by identity), so a
``jax.jit``/``nnx.jit`` inside the loss traces again instead of reusing a
program traced without the probes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx

# The Flax methods routed, by class: the calls the NNX capture captures.
ROUTED_METHODS: dict[type[nnx.Module], tuple[str, ...]] = {
  nnx.Linear: ("__call__",),
  nnx.LinearGeneral: ("__call__",),
  nnx.Conv: ("__call__",),
  nnx.Embed: ("__call__", "attend"),
}
# The metadata key of a Variable's ``Tag``.
TAG = "kfac_jax_capture"

# route(tag, method, original, module, *args, **kwargs): the call of
# ``method`` (a name of ROUTED_METHODS) of a layer whose kernel carries
# ``tag``; ``original`` is the Flax function.
Route = Callable[..., Any]


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity, see above
class Tag:
  """What a tagged ``Variable`` tells a routed call.

  Attributes:
    path: the Variable's path in the State (``("l1", "kernel")``).
    shape: its shape there, stack axes included.
    route: the capture's handler of the calls of the module holding it.
  """

  path: tuple[Any, ...]
  shape: tuple[int, ...]
  route: Route


def tagged(state: nnx.State, route: Route) -> nnx.State:
  """A copy of ``state`` whose Variables carry their ``Tag``s.

  The copy's Variables are new (``jax.tree.map`` rebuilds them), so the
  caller's State never holds a tag.

  Args:
    state: the State the loss is differentiated with respect to.
    route: the handler that calls of layers holding these Variables reach.

  Returns:
    The tagged copy, of ``state``'s structure.
  """
  copy = jax.tree.map(lambda leaf: leaf, state)
  for path, variable in nnx.to_flat_state(copy):
    if isinstance(variable, nnx.Variable):
      shape = tuple(getattr(variable.get_value(), "shape", ()))
      variable.set_metadata(TAG, Tag(tuple(path), shape, route))
  return copy


def tag_of(variable: Any) -> Tag | None:
  """The ``Tag`` of ``variable``; ``None`` when it carries none."""
  if not isinstance(variable, nnx.Variable):
    return None
  tag = variable.get_metadata().get(TAG)
  return tag if isinstance(tag, Tag) else None


def _router(
  cls: type[nnx.Module], method: str, original: Callable[..., Any]
) -> Callable[..., Any]:
  """``original`` (``cls.<method>``), sending tagged layers to their route."""
  key = "embedding" if issubclass(cls, nnx.Embed) else "kernel"

  @functools.wraps(original)
  def routed_method(self, *args, **kwargs):
    tag = tag_of(getattr(self, key, None))
    if tag is None:
      return original(self, *args, **kwargs)
    return tag.route(tag, method, original, self, *args, **kwargs)

  return routed_method


class _Routing:
  """The routers installed on the Flax classes while any capture needs
  them: counted, so that overlapping captures (two threads tracing) leave
  them until the last is done; a call without a tag runs as before."""

  def __init__(self):
    self.lock = threading.Lock()
    self.users = 0
    self.originals = {
      (cls, method): cls.__dict__[method]
      for cls, methods in ROUTED_METHODS.items()
      for method in methods
    }

  def acquire(self) -> None:
    with self.lock:
      if self.users == 0:
        for (cls, method), original in self.originals.items():
          setattr(cls, method, _router(cls, method, original))
      self.users += 1

  def release(self) -> None:
    with self.lock:
      self.users -= 1
      if self.users == 0:
        for (cls, method), original in self.originals.items():
          setattr(cls, method, original)


_ROUTING = _Routing()


@contextlib.contextmanager
def routed() -> Iterator[None]:
  """Within: the calls of tagged layers go to their tags' routes."""
  _ROUTING.acquire()
  try:
    yield
  finally:
    _ROUTING.release()
