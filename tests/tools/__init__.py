"""Tests of workers/tools/: the registry, the built-in tools and their handler threads."""
