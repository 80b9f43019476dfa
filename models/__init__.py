"""Tables, schemas, settings, engine helpers and hot-path SQL. Imports nothing of agents/ or tasks/."""
