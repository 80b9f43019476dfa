"""A producer process for the tests: ``python -m tests.support.produce OPERATION AGENT:REQUEST ...``.

Submits each request (in the order given) through the client, as a separate producer would."""

from __future__ import annotations

import sys

from agents.client import Client


def main(argv: list[str]) -> None:
    operation, pairs = argv[0], argv[1:]
    with Client.from_settings() as client:
        for pair in pairs:
            agent, request_id = pair.split(":", 1)
            client.submit(agent, request_id, {"n": request_id}, operation=operation, actor="producer")


if __name__ == "__main__":
    main(sys.argv[1:])
