"""``keel demo`` and ``keel up``: the main job, and the whole stack (worker, beat, Flower) run here until Ctrl-C."""

from __future__ import annotations

import sys

import click

from agents.cli.common import friendly, settings_or_exit


@click.command("demo")
@friendly
def demo() -> None:
    """The main job: scripted agents with a worker killed midway; exits 0 only if nothing ran twice."""
    from agents.demo.run import run_demo

    sys.exit(run_demo(settings_or_exit(), click.echo))


@click.command("up")
@click.option("--flower-port", default=5555, show_default=True, type=int)
@click.option("--concurrency", default=2, show_default=True, type=click.IntRange(min=1))
def up(flower_port: int, concurrency: int) -> None:
    """Run the whole stack here — worker, beat and Flower — on the configured or embedded servers, until Ctrl-C."""
    import os
    import signal
    import subprocess
    import time

    from models import migrations
    from models.embedded import broker_url_for, database_url_for

    settings = settings_or_exit(imports=True)
    env = dict(os.environ)
    env["KEEL_DATABASE_URL"] = database_url_for(settings)
    env["KEEL_BROKER_URL"] = broker_url_for(settings)
    migrations.upgrade(env["KEEL_DATABASE_URL"])
    commands = {
        "worker": ["worker", "-c", str(concurrency)],
        "beat": ["beat"],
        "flower": ["flower", "--port", str(flower_port), "--address=127.0.0.1"],
    }
    procs = {
        name: subprocess.Popen([sys.executable, "-m", "agents", *args], env=env, start_new_session=True)
        for name, args in commands.items()
    }
    click.echo(f"keel up: worker, beat and Flower (http://127.0.0.1:{flower_port}) running; Ctrl-C stops them")
    try:
        while all(p.poll() is None for p in procs.values()):
            time.sleep(0.5)
        dead = [name for name, p in procs.items() if p.poll() is not None]
        click.echo(f"keel up: {', '.join(dead)} exited; stopping the rest", err=True)
    except KeyboardInterrupt:
        click.echo("keel up: stopping")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


COMMANDS = (demo, up)
