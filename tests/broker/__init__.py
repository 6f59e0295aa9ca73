"""Tests of workers/broker/: the broker's wire (transport, envelope, send-only app) and job sending."""
