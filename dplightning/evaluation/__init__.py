"""Evaluation pipelines: scoring what a DP run produced (synthetic images) against real data.

Unlike :mod:`dplightning.metrics` (metric objects used inside training and testing), these train
their own classifiers and feature networks; ``python -m dplightning.evaluation.synthetic`` runs one.
"""
