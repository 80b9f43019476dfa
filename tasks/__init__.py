"""Celery glue: the app and its tasks (job runner, dispatcher, outbox relay, deadline enforcer) call agents/."""
