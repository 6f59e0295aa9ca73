"""The broker: forkq's kombu transport, the job envelope it builds, the send-only app, and job sending."""
