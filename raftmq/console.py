"""The CLI's rich console: a reader of stdout that went away ends a command as a ``print`` to it does.

rich's ``Console.on_broken_pipe`` raises ``SystemExit(1)``, and 1 is a command's "the cluster refused" (admin),
"a target was missed" or "nothing was acknowledged" (bench, chaos). ``PipeConsole`` raises ``BrokenPipeError``
instead, which ``raftmq.cli`` turns into the shell's 141 (``EXIT_BROKEN_PIPE``) without a traceback, so ``raftmq
admin cluster | head -1`` and ``raftmq bench store | head -3`` end as ``printf ... | head -1`` does.
"""

from __future__ import annotations

import errno
import os

from rich.console import Console

__all__ = ["PipeConsole"]


class PipeConsole(Console):
    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more is written where nobody reads
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))
