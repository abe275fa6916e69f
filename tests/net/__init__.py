"""Tests of :mod:`sequester.net`."""
