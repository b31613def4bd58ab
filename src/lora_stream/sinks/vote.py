"""Step 3 of a sync, check and vote: after the transfer, the checks that every engine holds what step 1 decided,
then every trainer rank's vote (the steps: :mod:`lora_stream.sinks.route`).

Who calls it: every sink, once per sync, after its transfer (step 2) and before step 4, on every rank alike. The
engines' own load check ran in step 2 (a bracket closed over every module, a partial update onto the base it was
computed against); here:

* when the sync is verified: a vote that every engine loaded (the trainer's forward is a collective), then the
  route's probe against it (:meth:`Route.verify <lora_stream.sinks.route.Route.verify>`) and any agreement across
  the engines (:meth:`Route.agree_on_verification <lora_stream.sinks.route.Route.agree_on_verification>`);
* while nothing failed: the prefix-cache reset (cached blocks were computed with the old weights), and what must
  hold before this rank votes to commit (:meth:`Route.before_vote <lora_stream.sinks.route.Route.before_vote>`);
* the vote to commit.

Every rank runs as many exchanges on every path: once a vote saw a failure, no rank votes again (a rank whose pass
ended early, under a sharded gatherer, learned it at a group boundary and would not join one more exchange). What
breaks if a rank skips this step: the others wait for its vote until the deadline, then roll back.
"""

from __future__ import annotations

from ..transaction import Transaction, fault_point
from .route import Checks
from .verify import Verification

__all__ = ["check_and_vote"]


def check_and_vote(tx: Transaction, route: Checks, *, verifying: bool, known: bool) -> Verification | None:
    """Run step 3 on this rank; return this rank's verification (``None``: not verified, or it failed). Whether every
    rank may commit is ``tx.ok`` afterwards, the same on every rank.

    ``verifying``: step 1's decision (the same on every rank); ``known``: the transfer's pass ended early, which
    told every rank already (``SyncSource.ended_early``): no vote then exchanges anything."""
    verification: Verification | None = None
    if verifying:
        if not tx.vote("after loading", known=known):
            return None
        with tx.attempt():
            verification = route.verify()
            fault_point("verify")
        route.agree_on_verification(tx)
    with tx.attempt() as go:
        if go:
            route.reset_prefix_cache()
            fault_point("prefix-cache")
            fault_point("commit")
            route.before_vote()
    tx.vote("before committing", known=known)
    return verification
