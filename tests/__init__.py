"""The tests of sequester, one folder per package (helpers in tests/helpers/, on sys.path)."""
