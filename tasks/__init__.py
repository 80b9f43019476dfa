"""Celery glue: the app, the job task and the beat dispatcher (which also enforces deadlines); they call agents/."""
