"""Tests of the vendor backends (a package, so that module names do not clash with the reference tests)."""
