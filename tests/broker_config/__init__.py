"""Tests of broker_config/: settings, the Celery configuration, the broker connection, Redis clients, the envelope."""
