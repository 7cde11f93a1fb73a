"""The contract's transactions, written once for every SQL engine.

``gate`` (R1), ``record`` (the operation table), ``fence`` (cancel, pause,
resume), ``owners`` (a share's link, a run left to its owners), ``approvals``
(approvals, checkpoints, audit), ``truth`` (leases, orphan recovery,
compensation links) and ``reads``, each an
``async def body(db)`` over the ``Db`` seam (``db``), with status guards
generated from the domain (``guards``) and the spellings that differ in a
``Dialect`` (``dialect``). ``SqlBackend`` serves the ``Backend`` seam with them.
"""

from __future__ import annotations

from stopline.ledger.engine.backend import SqlBackend
from stopline.ledger.engine.db import Db, run_sync
from stopline.ledger.engine.dialect import Dialect

__all__ = ["Db", "Dialect", "SqlBackend", "run_sync"]
