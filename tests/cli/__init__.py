"""Tests of :mod:`sequester.cli`."""
