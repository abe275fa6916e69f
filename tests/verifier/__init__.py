"""Tests of :mod:`sequester.verifier`."""
