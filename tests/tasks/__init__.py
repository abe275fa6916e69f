"""Tests of :mod:`sequester.tasks`."""
