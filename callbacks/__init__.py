"""Callbacks that plug into any Lightning project (installed as ``dplightning.callbacks``)."""

__all__: list[str] = []
