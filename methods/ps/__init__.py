"""The parameter-server family, as BytePS runs it: the worker transport (`transport.py`),
the node's host staging and root path (`node.py`), its stage threads (`stages.py`, the table
`harness.plan` prints `stage_table.py`), the scatter path's steps (`scatter.py`), the
node's one order of collectives (`order.py`), its shared host buffer (`shared.py`), the wire
protocol (`wire.py`) and the server (`server.py`, its engine threads' queue
`server_queue.py`). methods/README.md tells the design."""
