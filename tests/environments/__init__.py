"""Tests of :mod:`sequester.environments`."""
