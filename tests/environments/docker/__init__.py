"""Tests of :mod:`sequester.environments.docker`."""
