"""ShapedWork: the handle of one shaped collective, finishing no earlier than the model allows."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from netsim.shaping.annotate import waiting

if TYPE_CHECKING:
    from netsim.shaping.state import ShaperState

__all__ = ["ShapedWork"]


class ShapedWork(dist.Work):
    """Work whose wait() finishes the real op, then holds until the modeled completion time.

    Args:
        model_finish: modeled completion time of the transfer for a given start; None when the
            group is not shaped (count and trace only).
        arrival, sync: this rank's issue time being MAX-all-reduced over the group, and the work
            of that exchange; the modeled transfer starts when the last rank has arrived.
        span: (begin, finish) of the modeled transfer, asked once; point-to-point messages
            use it instead of `model_finish`, since their NIC booking is made per batch.
        issued_mono: time.monotonic() at the instant of `issued` (None: now).

    The modeled times are on the shaper's shared clock (wall time, which every process of the
    machine reads alike), but the hold is kept on the monotonic clock, `finish - issued` after
    the issue: a step of the wall clock (NTP setting it) while an op is held would otherwise
    end the hold early, and the op would take less than its bytes need at the link's rate.
    """

    def __init__(
        self,
        shaper: ShaperState,
        works: list[dist.Work],
        model_finish: Callable[[float], float] | None,
        row: dict | None,
        issued: float,
        arrival: torch.Tensor | None = None,
        sync: dist.Work | None = None,
        span: Callable[[], tuple[float, float]] | None = None,
        issued_mono: float | None = None,
    ) -> None:
        super().__init__()
        self._shaper = shaper
        self._works = works
        self._model_finish = model_finish
        self._row = row
        self._issued = issued
        self._issued_mono = time.monotonic() if issued_mono is None else issued_mono
        self._arrival = arrival
        self._sync = sync
        self._span_of = span
        self._shaped = model_finish is not None or span is not None
        self._done = False
        self._span: tuple[float, float] | None = None
        self._lock = threading.Lock()

    def _modeled(self) -> tuple[float, float]:
        """(begin, finish) of the modeled transfer; booked on the NIC once, when first asked."""
        if self._span is None and self._span_of is not None:
            self._span = self._span_of()
        if self._span is None:
            begin = self._issued
            if self._sync is not None:
                self._sync.wait()
                begin = float(self._arrival.max().item())
            self._span = (begin, self._model_finish(begin))
        return self._span

    def _held_until(self, finish: float) -> float:
        """The monotonic instant at which a hold to `finish` (shared clock) ends."""
        return self._issued_mono + (finish - self._issued)

    def _hold_until(self, finish: float) -> None:
        if self._shaper.mode == "wall":
            end = self._held_until(finish)
            # Sleep in slices: one long sleep can overshoot by a scheduler tick.
            while (left := end - time.monotonic()) > 0:
                time.sleep(min(left, 0.05))
        else:
            self._shaper.advance_to(finish)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:  # noqa: B008 - mirrors torch
        """Finish the real op, then hold (wall) or advance the clock (virtual) to the model."""
        with self._lock:
            if self._done:
                return True
            shaper = self._shaper
            waited = shaper.now()
            with waiting():  # when this rank began to wait, in a torch.profiler trace if any
                for work in self._works:
                    work.wait()
            modeled = math.nan
            if self._shaped:
                begin, finish = self._modeled()
                modeled = finish - begin
                self._hold_until(finish)
            if self._row is not None and shaper.recorder is not None:
                shaper.recorder.complete(
                    self._row, waited - shaper.t0, shaper.now() - shaper.t0, modeled
                )
            self._done = True
            return True

    def is_completed(self) -> bool:
        """Whether the op is done, at the modeled time (pollers that never wait() see it too)."""
        if self._done:
            return True
        if not all(w.is_completed() for w in self._works):
            return False
        if not self._shaped:
            return True
        if self._sync is not None and not self._sync.is_completed():
            return False
        with self._lock:
            _, finish = self._modeled()
        return self._shaper.mode != "wall" or time.monotonic() >= self._held_until(finish)

    def is_success(self) -> bool:
        """Same as is_completed(): failures surface as exceptions from wait()."""
        return self.is_completed()

    def result(self) -> Any:
        """The real op's result, after the modeled completion."""
        self.wait()
        return self._works[-1].result()

    def get_future(self) -> torch.futures.Future:
        """A future completed with result() at the modeled time."""
        future: torch.futures.Future = torch.futures.Future()

        def finish() -> None:
            try:
                future.set_result(self.result())
            except Exception as err:  # hand the failure to whoever waits on the future
                future.set_exception(err)

        # wait() may sleep for the modeled time, so never run it on the backend's own threads.
        threading.Thread(target=finish, daemon=True).start()
        return future
