"""Tests of :mod:`sequester.jobs`."""
