"""Tests of :mod:`sequester.images`."""
