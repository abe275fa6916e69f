"""Tests of :mod:`sequester.environments.local`."""
