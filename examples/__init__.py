"""kfac_jax's examples and the pieces they share with the benchmarks and tests.

Run an example from the repository root as a module, e.g.
``python -m examples.mnist_classifier``. The shared pieces: ``models`` (the
Flax models), ``datasets``, ``training`` (the side-by-side training loop),
``reporting`` (tables and plots), ``flags`` (the examples' command line),
``tasks`` and ``targets`` (the convergence race's training problems and its
time-to-target readouts), ``flops`` and ``hlo_cost`` (FLOP and per-device
cost counts).

Nothing is imported here: ``sharded_mnist`` sets ``XLA_FLAGS`` before jax is
first imported, and ``models`` must stay importable where ``kfac_jax`` is
DeepMind's package (``benchmarks/dm_kfac_step_time.py``).
"""
