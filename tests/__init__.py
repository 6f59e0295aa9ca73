"""forkq's tests: one folder per package of workers/ (and broker_config/), end-to-end runs in e2e/."""
