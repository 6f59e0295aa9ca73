"""forkq settings (the only reader of the environment) and the Celery configuration derived from them."""
