"""The pure core and the single writer: the phase table (``phases``), commands and ``decide`` (``commands``), the one
``transition()`` that changes an agent row (``transition``; creating, archiving and deleting one: ``lifecycle``), the
job rows and queues a transition inserts (``queues``), the hash-chained journal (``journal/``), keys, retry and budget
policies, errors and redaction. It imports nothing of ``agents`` outside this folder, only ``models``.
"""
