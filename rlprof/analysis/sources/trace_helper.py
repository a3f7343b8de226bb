"""The helper process of a large trace's reading (see :func:`rlprof.analysis.sources.chrome_trace.scan_trace`):
``python -m rlprof.analysis.sources.trace_helper TRACE FIRST CHUNK``.

It reads the same file, cut in the same batches (of about CHUNK bytes), decodes the batches that are its share
(:func:`~rlprof.analysis.sources.chrome_trace.helped`: two in three from batch FIRST on) and writes each one's
events to stdout as columns (:class:`~rlprof.analysis.trace_columns.EventColumns`), after a header of the batch's
index, its length and the length of the columns. It ends at the end of the file, on a layout other than kineto's
(the reading process then reads it alone), or when the reading process goes away (a closed pipe); Ctrl-C is for
the reading process.
"""

from __future__ import annotations

import gc
import signal
import sys
from pathlib import Path

from rlprof.analysis.sources.chrome_trace import HELPER_HEADER, decoded, feed, helped, iter_batches
from rlprof.analysis.trace_columns import EventColumns


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gc.disable()
    path, first, chunk = Path(argv[0]), int(argv[1]), int(argv[2])
    columns = EventColumns()
    out = sys.stdout.buffer
    try:
        for index, batch in enumerate(iter_batches(path, columns.scan, chunk)):
            if isinstance(batch, list):
                return 0
            if helped(index, first):
                feed(columns, decoded(batch, columns.scan))
                packed = columns.take()
                out.write(HELPER_HEADER.pack(index, len(batch), len(packed)))
                out.write(packed)
                out.flush()
    except BrokenPipeError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
