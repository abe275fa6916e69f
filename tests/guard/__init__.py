"""Tests of :mod:`sequester.guard`."""
