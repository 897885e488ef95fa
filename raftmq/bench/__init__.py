"""``raftmq bench KIND`` implementations, one module per kind (registered in ``raftmq.commands.bench``), and
``raftmq.bench.common`` with what they share: latency percentiles, progress bar, results table, spawned servers."""
