"""Tests of workers/store/: Redis records and their scripts on a real (private) Redis."""
