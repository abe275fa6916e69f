"""Tests of :mod:`sequester.sandbox`."""
