"""Tests of the cuda vendor backend."""
