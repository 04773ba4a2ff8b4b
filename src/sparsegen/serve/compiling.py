"""The default lane's compiled step, built in a thread of its own while the engine serves eagerly.

Compiling the batched step takes minutes on a fresh machine (one graph for one row, one for any
other count). A server that compiled before listening answered nothing for that long; this one
answers at once with the eager step, and the engine takes the compiled decoder between two
iterations once it is ready (`BackgroundCompile.take`). The model's Linear layers are already
given the few-row product for the engine's life (`few_rows.use_gemv`), so the thread's trace and
the engine's eager steps see the same model and neither changes it under the other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from sparsegen.decode import Decoder
from sparsegen.kv.spec import KVSpec

WARM_PROMPT = list(range(1, 9))


def warm(decoder: Decoder) -> None:
    """Compile `decoder`'s step for one row and for two (the graph that serves every count above
    one), on a short made-up prompt; the decoder is left with no rows."""
    for rows in (1, 2):
        caches, logits = decoder.prefill([WARM_PROMPT] * rows)
        decoder.start_from(caches, 1)
        decoder.step(logits.argmax(-1))
    decoder.leave(list(range(decoder.rows)))


class BackgroundCompile:
    """A thread that builds and warms one compiled `Decoder` for the KV spec `kv`.

    `first` (`serve.precompile.in_child`) runs before, to fill the compile caches from another
    process; if it fails the thread compiles from nothing. `ready` is set when it is done,
    compiled or failed (`notify` says why, and the engine keeps stepping eagerly). `take()` hands
    the decoder over once. `cancel()` (the engine closing) makes a decoder that finishes later
    give the model back instead of being handed over.
    """

    def __init__(
        self,
        make_decoder: Callable[[KVSpec], Decoder],
        kv: KVSpec,
        notify: Callable[[str], None],
        first: Callable[[], None] | None = None,
    ) -> None:
        self.kv, self._first = kv, first
        self.ready = threading.Event()
        self._make_decoder, self._notify = make_decoder, notify
        self._decoder: Decoder | None = None
        self._cancelled = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="sparsegen-compile", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._first is not None:
            try:
                self._first()
            except Exception as exc:  # noqa: BLE001 - the compile below still runs, from nothing
                self._notify(f"compiling in a child process failed ({type(exc).__name__}: {exc}); compiling here")
        if self._cancelled:  # the engine closed while the child compiled: nothing to build for
            self.ready.set()
            return
        decoder = self._make_decoder(self.kv)
        try:
            with torch.inference_mode():
                warm(decoder)
            failed = decoder.mode != "compiled"  # the decoder fell back to its eager step
        except Exception as exc:  # noqa: BLE001 - a failed compile leaves the server eager, never down
            self._notify(f"serving eagerly: compiling the decode step failed ({type(exc).__name__}: {exc})")
            failed = True
        with self._lock:
            if failed or self._cancelled:
                decoder.release()
            else:
                self._decoder = decoder
        self.ready.set()

    def take(self) -> Decoder | None:
        """The compiled decoder, once (None before `ready`, after a failure, or when taken)."""
        with self._lock:
            decoder, self._decoder = self._decoder, None
        return decoder

    def cancel(self) -> None:
        """The engine closes: a decoder still compiling is released when it is done; one ready
        and not taken is released now."""
        with self._lock:
            self._cancelled = True
            decoder, self._decoder = self._decoder, None
        if decoder is not None:
            decoder.release()
