"""Tests of the test suite's own helpers (tests/helpers/): the fixtures hold, so a failure elsewhere is sequester's."""
