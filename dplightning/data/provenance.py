"""Moved to :mod:`dplightning.privacy.provenance` (issue 26); this name stays importable for existing code."""

from dplightning.privacy.provenance import UNDECLARED_UNIT, PrivacyUnit, data_provenance, describe_privacy_unit

__all__ = ["UNDECLARED_UNIT", "PrivacyUnit", "data_provenance", "describe_privacy_unit"]
