"""Tests of workers/subagents/: definitions, scopes, capabilities and launch plans."""
