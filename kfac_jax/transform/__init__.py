"""Optax glue: the scale_by_kfac transformation, its hyper-parameters, aliases."""
