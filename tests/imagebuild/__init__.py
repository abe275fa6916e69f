"""Tests of :mod:`sequester.imagebuild`."""
