"""Tests of workers/history/: the parent's messages, the fork seed's selection, snapshots and structured output."""
