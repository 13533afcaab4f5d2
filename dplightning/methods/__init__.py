"""Routines of one method that run around a fit rather than inside it.

* :mod:`~dplightning.methods.adaln_bounds`: DP-aware AdaLN-Zero's bounds set from held-out data (a non-private
  model trained on the validation months only), and the rule that declares an arm's bounds vacuous
  (``python -m dplightning.methods.adaln_bounds --help``).

Nothing is imported here, so that importing one routine loads only what it needs.
"""
