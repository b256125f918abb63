"""Optax glue: the scale_by_kfac transformation, hyper-parameters, aliases."""
