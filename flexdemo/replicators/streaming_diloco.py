"""Streaming DiLoCo: DiLoCo's outer step per fragment, on staggered steps, overlapped by tau."""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from .._checks import check
from ..knobs import StreamingDiLoCoKnobs
from ..program import Op, Program
from ..wire import CommStats
from .base import Group, Replicator, copy_state
from .outer_wire import Pending, make_outer_wire


class StreamingProgram(Program):
    """Streaming DiLoCo's exchange: one fragment's sync posted after the step that prepares it,
    in the outer wire's format, waited on after the step that applies it."""

    def __init__(self, replicator: StreamingDiLoCoReplicator, pieces: list[list[Piece]],
                 replicas: int) -> None:
        self.prepared_on = replicator.fragment_prepared_on
        self.applied_on = replicator.fragment_applied_on
        self.wire, self.pieces = replicator.wire, pieces
        self.numels = [sum(b - a for _, a, b in f) for f in pieces]
        self.period, self.exchanges = replicator.sync_every, replicator.num_fragments
        # Every fragment's anchor and outer momentum, the rounding residuals of a lossy wire,
        # and the largest fragment's sync in flight (all-gathered: every replica's payload).
        shard = sum(self.numels)
        op, nbytes = self.wire.payload(max(self.numels))
        in_flight = nbytes * (replicas if op == "all_gather" else 1)
        self.state_bytes = 2 * shard * 4 + (shard * 4 if self.wire.lossy else 0) + in_flight

    def posts(self, step: int) -> list[Op]:
        """The fragment prepared after this step (nothing where this rank holds none of it:
        nothing crosses, the replicator's rule)."""
        fragment = self.prepared_on(step)
        if fragment is None or self.numels[fragment] == 0:
            return []
        return [Op(*self.wire.payload(self.numels[fragment]), key=fragment)]

    def waits(self, step: int) -> list[Hashable]:
        """The fragment applied after this step."""
        fragment = self.applied_on(step)
        return [] if fragment is None else [fragment]

    def unit_elements(self, step: int) -> dict[Hashable, dict[int, int]]:
        """The fragment prepared after this step, parameter by parameter."""
        fragment = self.prepared_on(step)
        if fragment is None:
            return {}
        elements: dict[int, int] = {}
        for i, a, b in self.pieces[fragment]:
            elements[i] = elements.get(i, 0) + b - a
        return {fragment: elements}


class StreamingDiLoCoReplicator(Replicator):
    """Streaming DiLoCo (Douillard et al. 2025), with torchft's ``DiLoCo`` schedule and update.

    The parameter list is cut into ``num_fragments`` contiguous runs of whole parameters:
    fragment f holds parameters ``[n*f // F, n*(f+1) // F)`` of the ``n`` the optimizer hands
    in (``model.parameters()`` order: embeddings, block 0, block 1, ..., head), the way
    torchft's ``model_fragments`` are contiguous pieces of the model. With ``fragment_cut =
    "elements"`` the cut is by element instead: fragment f holds elements ``[N*f // F,
    N*(f+1) // F)`` of the ``N`` in the parameters laid end to end, so a parameter the cut falls
    in is split between two fragments and every sync sends the same bytes (to one element);
    with ``fragment_runs = R > 1`` those elements are cut into ``F*R`` equal runs and run r
    belongs to fragment ``r % F``: each fragment is R runs strided over the model's depth, as
    the paper's strided fragments are layers spread over it.
    Each fragment keeps its own anchor (its parameters at its last sync) and its own outer
    ``torch.optim.SGD(nesterov=True)``.

    Schedule (1-based steps, ``P = sync_every // num_fragments``, ``tau =
    fragment_sync_delay``): the k-th sync (k = 0, 1, ...) belongs to fragment ``k %
    num_fragments``; it is *prepared* after step ``(k+1)*P - tau`` (pseudo-gradient anchor -
    params, its collective posted without waiting) and *applied* after step ``(k+1)*P``: the
    mean pseudo-gradient drives the fragment's outer step from its anchor, and the fragment
    becomes ``alpha * local + (1 - alpha) * synced`` (``fragment_update_alpha``; torchft's
    ``lerp_(local, alpha)`` from the synced values). So fragment f syncs every ``sync_every``
    steps at offset ``(f+1)*P``, evenly spread; with ``tau = 0`` both happen after the same
    step; with one fragment it is DiLoCo. The inner steps run between prepare and apply still
    move the fragment, and reach the result only through ``alpha`` (as torchft).

    ``outer_format`` other than fp32 rounds what is sent (:mod:`.outer_wire`); the rounding
    error stays on this replica and is added to that fragment's next pseudo-gradient. With a
    single replica nothing crosses a network and the pseudo-gradient is used as is.

    After the last step a posted sync may still be in flight: :meth:`drain` waits on it and
    drops it, never applied (applying it would be a step after the run's last one); a later
    apply step with nothing in flight for its fragment skips that sync, leaving the anchor,
    and the fragment's next pseudo-gradient covers the drift since. :meth:`state_dict` waits
    on what is in flight and saves its mean, so a resumed run applies what this one would.

    Off-schedule steps are the inner optimizer only (the base: AdamW, no sign).
    Knobs: :class:`flexdemo.knobs.StreamingDiLoCoKnobs`.
    """

    name = "streaming-diloco"
    knobs_type = StreamingDiLoCoKnobs
    default_base = "adamw"
    default_sign = False
    sync_in_backward = True

    def __init__(self, knobs: StreamingDiLoCoKnobs | None = None, **given: Any) -> None:
        super().__init__(knobs, **given)
        self.period = self.sync_every // self.num_fragments
        self.wire = make_outer_wire(self.outer_format)
        self.steps = 0  # steps seen (replicate + accumulate), the schedule's clock
        self.in_flight: dict[int, Pending] = {}

    @classmethod
    def program(cls, knobs: StreamingDiLoCoKnobs, shard_shapes: Sequence[tuple[int, ...]],
                replicas: int, *, node: int = 0, graph: str | None = None) -> StreamingProgram:
        """Each fragment's sync on the replicator's schedule, cut by :func:`fragment_pieces`
        and sized by the outer wire (:class:`StreamingProgram`)."""
        sizes = [math.prod(s) for s in shard_shapes]
        pieces = fragment_pieces(sizes, knobs.num_fragments, knobs.fragment_cut,
                                 knobs.fragment_runs)
        return StreamingProgram(cls(knobs), pieces, replicas)

    # -- the schedule ----------------------------------------------------------------------
    def _sync_due(self, step: int) -> int | None:
        # torchft: the k-th sync lands at step (k + 1) * P and is fragment k mod F.
        if step < 1 or step % self.period != 0:
            return None
        return (step // self.period - 1) % self.num_fragments

    def fragment_prepared_on(self, step: int) -> int | None:
        """The fragment whose sync is posted after 1-based step ``step``, or None."""
        return self._sync_due(step + self.fragment_sync_delay) if step >= 1 else None

    def fragment_applied_on(self, step: int) -> int | None:
        """The fragment whose sync is applied after 1-based step ``step``, or None."""
        return self._sync_due(step)

    def replicates_on(self, step: int) -> bool:
        """A step that posts or applies some fragment's sync."""
        return self.fragment_prepared_on(step) is not None or \
            self.fragment_applied_on(step) is not None

    # -- setup -----------------------------------------------------------------------------
    def setup(self, params: list[torch.Tensor], group: Group, ranks: int) -> None:
        """Cut the fragments and give each its anchor and outer optimizer."""
        super().setup(params, group, ranks)
        if self.fragment_cut == "elements":
            self.pieces = _element_pieces(params, self.num_fragments, self.fragment_runs)
            # The parameters a fragment touches, whole or in part (strided runs skip some).
            self.fragments = [sorted({i for i, _, _ in f}) for f in self.pieces]
        else:
            self.fragments = _parameter_runs(len(params), self.num_fragments)
            self.pieces = [[(i, 0, params[i].numel()) for i in r] for r in self.fragments]
        self.anchors = [[_piece(params, piece).detach().clone() for piece in pieces]
                        for pieces in self.pieces]
        # torch refuses Nesterov without momentum: momentum 0 is plain SGD.
        self.outers = [torch.optim.SGD(a, lr=self.outer_lr, momentum=self.outer_momentum,
                                       nesterov=self.outer_momentum > 0) for a in self.anchors]
        self.numels = [[a.numel() for a in anchors] for anchors in self.anchors]
        device = params[0].device
        self.residuals = [torch.zeros(sum(ns), dtype=torch.float32, device=device)
                          for ns in self.numels] if self.wire.lossy else None

    # -- the optimizer's hooks -------------------------------------------------------------
    def replicate(self, grads: list[torch.Tensor], lrs: list[float],
                  stats: CommStats) -> list[torch.Tensor]:
        """The inner step of a syncing step is local too; the sync follows it."""
        self.steps += 1
        return grads

    def accumulate(self, grads: list[torch.Tensor], lrs: list[float]) -> list[torch.Tensor]:
        """An inner step only."""
        self.steps += 1
        return grads

    def after_update(self, params: list[torch.Tensor], stats: CommStats) -> None:
        """Post this step's fragment sync, then apply the one due (the same one when tau=0)."""
        prepared = self.fragment_prepared_on(self.steps)
        if prepared is not None:
            self.in_flight[prepared] = self.prepare(prepared, params, stats)
        applied = self.fragment_applied_on(self.steps)
        if applied is not None:
            self.apply(applied, params)

    def prepare(self, f: int, params: list[torch.Tensor], stats: CommStats) -> Pending:
        """Fragment ``f``'s pseudo-gradient (plus carried rounding error), its collective posted."""
        local = [_piece(params, piece) for piece in self.pieces[f]]
        x = torch.cat([(a - p).reshape(-1).float()
                       for a, p in zip(self.anchors[f], local, strict=True)])
        if self.ranks == 1 or x.numel() == 0:
            return Pending.done(x)  # nothing crosses a network (same shapes on every replica)
        if self.residuals is not None:
            x += self.residuals[f]
        payload, read = self.wire.encode(x)
        if self.residuals is not None:
            self.residuals[f] = x - read  # error feedback: what rounding lost goes next time
        return self.wire.post(payload, x.numel(), self.group, self.ranks, stats)

    def apply(self, f: int, params: list[torch.Tensor]) -> None:
        """Wait for fragment ``f``'s mean, step its anchor, move the fragment there (alpha)."""
        pending = self.in_flight.pop(f, None)
        if pending is None:
            return  # drained (or never posted): skipped, see the class docstring
        anchors = self.anchors[f]
        for a, g in zip(anchors, pending.mean().split(self.numels[f]), strict=True):
            a.grad = g.view(a.shape).to(a.dtype)
        self.outers[f].step()
        alpha = self.fragment_update_alpha
        for a, piece in zip(anchors, self.pieces[f], strict=True):
            a.grad = None
            p = _piece(params, piece)
            local = p.clone() if alpha else None
            p.copy_(a)
            if local is not None:
                p.lerp_(local, alpha)  # torchft's merge: synced + alpha * (local - synced)

    def drain(self) -> None:
        """Wait for every sync still in flight and drop it, never applied."""
        pending, self.in_flight = self.in_flight, {}
        for p in pending.values():
            p.wait()

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Anchors, outer momenta, carried errors, the step clock and the syncs in flight."""
        # Waited on here so that a resumed run applies exactly the mean this one would.
        in_flight = {f: p.mean().clone() for f, p in self.in_flight.items()}
        return {"steps": self.steps,
                "anchors": [a.clone() for anchors in self.anchors for a in anchors],
                # deep copies: SGD hands back its live momentum buffers, which later steps move
                "outer": [copy.deepcopy(o.state_dict()) for o in self.outers],
                "residuals": None if self.residuals is None
                else [r.clone() for r in self.residuals],
                "in_flight": in_flight}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved (over the same parameters and knobs)."""
        copy_state([a for anchors in self.anchors for a in anchors], state["anchors"])
        check(len(state["outer"]) == len(self.outers),
              f"state holds {len(state['outer'])} fragments but this replicator has "
              f"{len(self.outers)}; load it with the num_fragments it was saved with.")
        for o, saved in zip(self.outers, state["outer"], strict=True):
            o.load_state_dict(saved)
        if self.residuals is not None and state["residuals"] is not None:
            copy_state(self.residuals, state["residuals"])
        self.steps = int(state["steps"])
        self.in_flight = {}
        for f, mean in state["in_flight"].items():
            size = sum(self.numels[int(f)])
            check(mean.numel() == size,
                  f"state's sync in flight for fragment {f} holds {mean.numel()} values but "
                  f"that fragment has {size}; load a state saved over the same parameters.")
            self.in_flight[int(f)] = Pending.done(mean.to(self.anchors[0][0].device, copy=True))


# A fragment's piece of one parameter: (parameter index, first element, end element).
Piece = tuple[int, int, int]


def _parameter_runs(n: int, frags: int) -> list[range]:
    """Fragment f holds parameters [n*f // F, n*(f+1) // F): contiguous runs of whole ones."""
    check(frags <= n, f"num_fragments={frags} is more than the {n} parameter tensors handed "
                      "in; fragments are runs of whole parameters, so use num_fragments <= "
                      f"{n} (or fragment_cut='elements').")
    cuts = [n * f // frags for f in range(frags + 1)]
    return [range(cuts[f], cuts[f + 1]) for f in range(frags)]


def fragment_numels(sizes: list[int], frags: int, cut: str, runs: int = 1) -> list[int]:
    """Elements of each fragment of parameters of these sizes, cut as ``fragment_cut`` says.

    The replicator's own cut (:meth:`StreamingDiLoCoReplicator.setup`) from sizes alone, so the
    planner sizes every fragment's sync as the run does. ValueError (one sentence) for more
    fragments than there are parameters (or elements) to cut.
    """
    return [sum(b - a for _, a, b in pieces)
            for pieces in fragment_pieces(sizes, frags, cut, runs)]


def fragment_pieces(sizes: list[int], frags: int, cut: str, runs: int = 1) -> list[list[Piece]]:
    """Each fragment's (parameter index, first element, end element) pieces, cut as
    ``fragment_cut`` and ``fragment_runs`` say (the replicator's own cut; ValueError as
    :func:`fragment_numels`)."""
    if cut == "elements":
        return _element_cuts(sizes, frags, runs)
    return [[(i, 0, sizes[i]) for i in run] for run in _parameter_runs(len(sizes), frags)]


def _element_cuts(sizes: list[int], frags: int, runs: int = 1) -> list[list[Piece]]:
    """The parameters laid end to end cut into F*R equal runs, run r [N*r // (F*R),
    N*(r+1) // (F*R)) in fragment r % F; each fragment's pieces in parameter order."""
    total, cuts = sum(sizes), frags * runs
    what, use = (f"num_fragments={frags}", f"num_fragments <= {total}") if runs == 1 else (
        f"num_fragments * fragment_runs = {frags} * {runs}", f"at most {total} runs in all")
    check(cuts <= total, f"{what} is more than the {total} parameter elements handed in; use "
                         f"{use}.")
    starts = [0, *itertools.accumulate(sizes)][:-1]
    out: list[list[Piece]] = [[] for _ in range(frags)]
    for r in range(cuts):
        lo, hi = total * r // cuts, total * (r + 1) // cuts
        out[r % frags].extend((i, max(lo, s) - s, min(hi, s + n) - s)
                              for i, (s, n) in enumerate(zip(starts, sizes, strict=True))
                              if max(lo, s) < min(hi, s + n))
    return out


def _element_pieces(params: list[torch.Tensor], frags: int, runs: int = 1) -> list[list[Piece]]:
    """The element cut of ``params`` (:func:`_element_cuts`), checked for in-place views."""
    sizes = [p.numel() for p in params]
    out = _element_cuts(sizes, frags, runs)
    for i in {i for pieces in out for i, a, b in pieces if (a, b) != (0, sizes[i])}:
        # a split parameter is read and written through a flat view of its storage
        check(params[i].is_contiguous(), f"parameter {i} is not contiguous, so "
              "fragment_cut='elements' cannot split it; use fragment_cut='parameters'.")
    return out


def _piece(params: list[torch.Tensor], piece: Piece) -> torch.Tensor:
    """The parameter itself when the piece is all of it, else a flat view of its elements."""
    i, start, end = piece
    p = params[i]
    return p if (start, end) == (0, p.numel()) else p.view(-1)[start:end]
