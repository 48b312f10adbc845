"""The stages of a PS worker's pipeline (methods/ps/stages.py), one thread each, as
`harness.plan` prints them (`stage_lines`); torch-free, as the planner's imports must be."""

from __future__ import annotations

PULL_WAITERS = 8  # the root's pulls waited on at once: they land in any order within these
ORDERS = {"scatter": "ps-reduce's partition order and the root's landing order",
          "root": "ps-reduce's unit order, ps-broadcast in unit order"}
# (thread, what it runs per item, who runs it); the order of a partition's way through
STAGES = {
    "scatter": [
        ("ps-reduce", "per partition: reduce-scatter in the node (leftover: reduce to root)",
         "every worker"),
        ("ps-copy-out", "per partition: own slice -> the node's shared host buffer",
         "every worker"),
        ("ps-push", "per partition: slices there? push it, post its pull (others: tell root)",
         "root / others"),
        ("ps-pull", "per partition, as each completes: the pull lands (others: root's word)",
         "root: PULL_WAITERS threads / others: one"),
        ("ps-copy-in", "per partition, in landing order: own slice <- shared buffer",
         "every worker"),
        ("ps-gather", "per partition, in landing order: all-gather (leftover: broadcast)",
         "every worker"),
    ],
    "root": [
        ("ps-reduce", "per unit: reduce to the node's root", "every worker"),
        ("ps-copy-out", "per unit: device -> pinned host mirror (CPU: none)", "root"),
        ("ps-push", "per server: header; per partition: push, post its pull", "root"),
        ("ps-pull", "per partition, as each completes: the pull lands",
         "root: PULL_WAITERS threads"),
        ("ps-copy-in", "per partition, in landing order: host -> device", "root"),
        ("ps-broadcast", "per unit, in unit order: broadcast from the root", "every worker"),
    ],
}


def stage_lines(node_reduce: str, per_node: int) -> list[str]:
    """The stages a PS worker runs (`harness.plan`): thread, work per item, who runs it."""
    path = node_reduce if per_node > 1 else "root"
    rows = [(t, w, "every worker" if per_node == 1 else who) for t, w, who in STAGES[path]]
    if per_node == 1:  # a node of one worker: no collective, it is its own root
        rows = [(t, w.replace("reduce to the node's root", "wait for the gradients")
                 .replace("broadcast from the root", "the unit has landed"), who)
                for t, w, who in rows]
    rows = [(t, w, who.replace("PULL_WAITERS", str(PULL_WAITERS))) for t, w, who in rows]
    head = f"PS pipeline ({path} path, {per_node} worker(s) a node), a thread per stage:"
    order = [f"  the node's collectives go in the root's order: {ORDERS[path]}"] \
        if per_node > 1 else []
    return [head] + [f"  {t:<13} {w}  [{who}]" for t, w, who in rows] + order
