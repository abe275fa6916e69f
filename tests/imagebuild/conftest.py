"""Fixtures of the image-build tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from sequester.environments.settings import EpisodeSettings
from sequester.verifier.tree import runner_tree


@pytest.fixture(scope="module")
def runner() -> Path:
    """The verifier's runner tree, which every RUN of a build runs with (skips if it cannot
    be built here)."""
    tree = runner_tree(EpisodeSettings().toolchain_dir)
    if tree is None:
        pytest.skip("the verifier's runner could not be built")
    return tree
