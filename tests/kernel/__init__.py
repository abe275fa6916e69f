"""Tests of :mod:`sequester.kernel`."""
