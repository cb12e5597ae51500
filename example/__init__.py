"""A small payments API that shows Flask-Idempotency at work (``make run``)."""
