"""The Celery app's reliability settings, and the one visibility timeout they share."""

from __future__ import annotations

import pytest
import redis.exceptions
from kombu import Connection
from kombu.transport import redis as kombu_redis
from pydantic import ValidationError

from models.settings import Settings
from tasks.app import celery_config
from tasks.kombu_guard import guard_redis_transport

PG = "postgresql://u@localhost/db"


def test_reliable_defaults() -> None:
    config = celery_config(Settings(database_url=PG, broker_url="redis://localhost:6379/3"))
    assert config["task_acks_late"] and config["task_reject_on_worker_lost"]
    assert config["worker_prefetch_multiplier"] == 1
    assert config["worker_soft_shutdown_timeout"] > 0
    assert config["worker_cancel_long_running_tasks_on_connection_loss"] is False, "a broker blip must not kill steps"
    assert config["task_ignore_result"] and config["result_backend"] is None
    assert {q.name for q in config["task_queues"]} == {"keel.jobs", "keel.jobs.low", "keel.outbox"}
    assert config["task_routes"]["keel.relay_outbox"] == {"queue": "keel.outbox"}
    relay = config["beat_schedule"]["relay-outbox"]
    assert (relay["task"], relay["options"]["queue"]) == ("keel.relay_outbox", "keel.outbox")


def test_a_redis_channel_still_knows_its_server_after_its_transport_was_detached() -> None:
    """The app guards kombu's Redis channels (tasks/kombu_guard.py): Celery's cleanup of a lost connection detaches
    the transport before it closes the channel that restores the unacknowledged message (the bare worker's crash:
    tests/chaos/test_kombu_lost_connection.py)."""
    guard_redis_transport()  # again: it wraps once
    assert not getattr(kombu_redis.Channel._connparams.__wrapped__, "keel_guard", False)
    connection = Connection("redis://127.0.0.1:6390/5")
    used, unused = kombu_redis.Channel.__new__(kombu_redis.Channel), kombu_redis.Channel.__new__(kombu_redis.Channel)
    used.connection = unused.connection = connection.transport
    assert used._connparams()["port"] == 6390
    connection.transport.client = None  # what Connection.collect() does
    assert (used._connparams()["port"], used._connparams()["db"]) == (6390, 5)
    with pytest.raises(redis.exceptions.ConnectionError):  # which Celery's cleanup ignores, as when Redis is down
        unused._connparams()


def test_task_events_are_off_unless_asked_for() -> None:
    """They cost broker messages on every job; a running Flower turns them on (tests/chaos/test_task_events.py)."""
    config = celery_config(Settings(database_url=PG, broker_url="redis://localhost:6379/3"))
    assert (config["worker_send_task_events"], config["task_send_sent_event"]) == (False, False)
    config = celery_config(Settings(database_url=PG, broker_url="redis://localhost:6379/3", worker_task_events=True))
    assert (config["worker_send_task_events"], config["task_send_sent_event"]) == (True, True)


def test_one_visibility_timeout_everywhere() -> None:
    settings = Settings(database_url=PG, broker_url="redis://localhost/0", visibility_timeout_seconds=120)
    transport = celery_config(settings)["broker_transport_options"]
    assert transport["visibility_timeout"] == 120
    # Workers sweep for abandoned messages often enough for the timeout to mean what it says.
    assert transport["unacked_restore_interval"] * transport["unacked_restore_throttle"] <= 120 / 6


def test_the_broker_prefix_goes_before_every_key_and_channel() -> None:
    def transport(**prefix: str) -> dict[str, object]:
        options: dict[str, object] = celery_config(Settings(database_url=PG, broker_url="redis://h/0", **prefix))[
            "broker_transport_options"
        ]
        return options

    assert transport()["global_keyprefix"] == "", "no prefix unless one is set: existing deployments keep their keys"
    assert transport(broker_prefix="keel-staging:")["global_keyprefix"] == "keel-staging:"


def test_a_lease_longer_than_the_visibility_timeout_is_refused() -> None:
    with pytest.raises(ValidationError, match="KEEL_JOB_LEASE_SECONDS: must be shorter"):
        Settings(job_lease_seconds=600, visibility_timeout_seconds=300)


def test_retry_policy_names_known_classes() -> None:
    with pytest.raises(ValidationError, match="unknown error classes"):
        Settings(retry_policy={"sometimes": {"max_attempts": 2}})


def test_celerys_warning_about_a_setting_keel_sets_is_debug_and_others_stay(caplog: pytest.LogCaptureFixture) -> None:
    """Celery repeats it at every lost broker connection; Keel sets the setting on purpose (invariant 12)."""
    import logging

    from tasks.logs import WARNINGS_LOGGER, quiet_housekeeping

    quiet_housekeeping(["keel.relay_outbox"])
    warnings_log = logging.getLogger(WARNINGS_LOGGER)
    with caplog.at_level(logging.WARNING, logger=WARNINGS_LOGGER):
        warnings_log.warning(
            "%s",
            "consumer.py:427: CPendingDeprecationWarning: \nIn Celery 5.1 … the"
            " worker_cancel_long_running_tasks_on_connection_loss setting …",
        )
        warnings_log.warning("%s", "some.py:1: CPendingDeprecationWarning: something else")
    assert [r.getMessage() for r in caplog.records] == ["some.py:1: CPendingDeprecationWarning: something else"]
