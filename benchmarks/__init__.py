"""kfac_jax's benchmarks: run each from the repository root as a module,
``python -m benchmarks.<name>`` (``benchmarks/README.md``).

Nothing is imported here: ``step_time`` sets the BLAS threads and ``scaling``
the simulated devices before jax is first imported, and the DeepMind scripts
load DeepMind's ``kfac_jax`` before anything imports ours
(``deepmind_kfac``).
"""
