"""Tests of :mod:`sequester.cluster`."""
