"""Tests of :mod:`sequester.serve`."""
