"""Tests of broker_config/: settings, the Celery configuration and Redis clients."""
