"""Tests of workers/api/: the HTTP API, its bodies, tokens, event streams, contract, server and web view."""
