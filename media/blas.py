"""numpy's matrix products on the calling thread alone.

numpy's bundled OpenBLAS runs a product on a pool of one thread per core, and an idle worker of
that pool spins for about a tenth of a second after each product before it sleeps. Whisper's mel
spectrogram is one small product per decode: with the pool, a decode of a 2.4 s utterance cost
249 ms of CPU instead of 131 ms (the spinning thread, started with numpy at the event loop's
priority, took the rest), and it was no faster. Nothing the server computes with numpy is big
enough to gain from a second thread.
"""

from __future__ import annotations

import functools

from threadpoolctl import threadpool_limits

__all__ = ["single_threaded_blas"]


@functools.cache
def single_threaded_blas() -> None:
    """Limit the BLAS libraries loaded in this process to one thread each (process-wide, once;
    a library loaded later keeps its own default)."""
    threadpool_limits(limits=1, user_api="blas")
