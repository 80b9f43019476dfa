"""``keel demo``: scripted agents run end to end (``run``), the local fake Slack, GitHub and LLM servers they talk to
(``fake_servers``, which the tests use too) and the demo's tool (``tools``). Nothing in the product imports this
package; the CLI and the tests may.
"""
