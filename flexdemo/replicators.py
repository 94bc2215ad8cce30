"""Replicators: how the shard gradients of one replica are exchanged with the other replicas."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .chunking import BlockLayout, largest_divisor_at_most, matrix_shape
from .codec import clamp_topk, decode_indices, encode_indices, index_dtype, mean_decode, topk_encode
from .dct import dct_chunked, idct_chunked
from .wire import CommStats, all_gather_bytes, all_reduce_bytes, pack, plan_bucket, unpack

Group = dist.ProcessGroup | None


class Replicator:
    """Base class: turns local shard gradients into the gradients every replica applies.

    The optimizer calls :meth:`replicate` on replicating steps, :meth:`accumulate` on steps the
    schedule skips and :meth:`after_update` once the parameters have moved. Every collective goes
    over ``group`` (one rank per node) and is recorded in the ``CommStats`` it is handed.
    """

    name = "base"
    owns_updates = False

    def setup(self, params: list[torch.Tensor], group: Group, ranks: int) -> None:
        """Allocate state for the local shards ``params`` replicated over ``ranks`` ranks."""
        self.group = group
        self.ranks = ranks

    def replicate(self, grads: list[torch.Tensor], lrs: list[float],
                  stats: CommStats) -> list[torch.Tensor]:
        """Return the gradient each shard applies this step."""
        raise NotImplementedError

    def accumulate(self, grads: list[torch.Tensor], lrs: list[float]) -> None:
        """Fold gradients of a step without replication into the local state (if any)."""

    def after_update(self, params: list[torch.Tensor], lrs: list[float],
                     stats: CommStats) -> None:
        """Hook run after the parameters were updated (DiLoCo's outer step lives here)."""

    def state_dict(self) -> dict:
        """Tensors and counters needed to resume exactly."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""

    def _all_reduce_mean(self, flat: torch.Tensor, stats: CommStats) -> torch.Tensor:
        # gloo has no AVG reduction: sum, then divide.
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        n = flat.numel() * flat.element_size()
        stats.add(all_reduce_bytes(n, self.ranks), all_reduce_bytes(n, self.ranks))
        return flat.div_(self.ranks)


def _copy_state(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    if len(dst) != len(src):
        raise ValueError(f"state holds {len(src)} tensors but this optimizer has {len(dst)}; "
                         "load a state_dict saved by an optimizer over the same parameters.")
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


def _all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Group) -> object:
    # torch 2.13 renamed all_gather_into_tensor; older releases only have the old name.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, inp, group=group, async_op=True)


class _BlockGroup:
    """Same-shaped DCT blocks of several shards, transformed and coded as one batch."""

    def __init__(self, c1: int, c2: int, topk: int, dtype: torch.dtype, device: torch.device):
        self.c1, self.c2 = c1, c2
        self.k = clamp_topk(topk, c1 * c2)
        self.members: list[tuple[int, BlockLayout, int, int]] = []
        self.num_blocks = 0
        self.dtype, self.device = dtype, device
        self.delta = torch.empty(0)

    def add(self, index: int, layout: BlockLayout) -> None:
        start = self.num_blocks
        self.num_blocks += layout.num_blocks
        self.members.append((index, layout, start, self.num_blocks))

    def allocate(self) -> None:
        """Create delta and the buffers reused every step."""
        # Momentum lives in the DCT domain: the transform is orthonormal and linear, so this
        # equals DeMo's delta up to rounding and saves one inverse transform per step.
        self.delta = torch.zeros(self.num_blocks, self.c1 * self.c2, dtype=self.dtype,
                                 device=self.device)
        # Buffers reused every step: on CPU, fresh multi-megabyte tensors are returned to the
        # OS when freed and page-fault back in on the next step, which cost as much as the
        # inverse transform itself.
        self.updates = {i: torch.empty(layout.rows, layout.cols, dtype=self.dtype,
                                       device=self.device) for i, layout, _, _ in self.members}
        largest = max(layout.rows * layout.cols for _, layout, _, _ in self.members)
        self.scratch = [torch.empty(largest, dtype=self.dtype, device=self.device)
                        for _ in range(2)]
        # Decoding scatters straight into the members' natural layouts, laid end to end, so
        # the inverse transform needs no block-to-natural copy. Per block: where its (0, 0)
        # coefficient sits in that flat buffer and the row stride of its member.
        bases, strides, offset = [], [], 0
        self.natural_offsets = []
        for _, layout, _, _ in self.members:
            brows, bcols = layout.rows // layout.c1, layout.cols // layout.c2
            a = torch.arange(brows).repeat_interleave(bcols)
            b = torch.arange(bcols).repeat(brows)
            bases.append(offset + a * layout.c1 * layout.cols + b * layout.c2)
            strides.append(torch.full((layout.num_blocks,), layout.cols))
            self.natural_offsets.append(offset)
            offset += layout.rows * layout.cols
        self.block_base = torch.cat(bases).to(self.device).unsqueeze(1)
        self.block_stride = torch.cat(strides).to(self.device).unsqueeze(1)
        self.decoded = torch.zeros(offset, dtype=self.dtype, device=self.device)

    def fold(self, grads: list[torch.Tensor], lrs: list[float], decay: float) -> None:
        for i, layout, s, e in self.members:
            # delta <- decay*delta + lr*DCT(g) in one pass: lerp towards lr*DCT(g)/(1-decay),
            # with that factor folded into the small basis matrix.
            weight = 1.0 - decay
            coeffs = dct_chunked(grads[i].reshape(layout.rows, layout.cols), layout.c1, layout.c2,
                                 scratch=self.scratch[0], out=self.scratch[1],
                                 scale=lrs[i] / weight)
            # The strided update doubles as the copy from natural into block layout.
            self.delta[s:e].view(-1, layout.cols // layout.c2, layout.c1, layout.c2).lerp_(
                layout.blocks_view(coeffs), weight)

    def scatter_back(self, coeffs: torch.Tensor, out: list[torch.Tensor],
                     shapes: list[torch.Size]) -> None:
        for i, layout, s, e in self.members:
            natural = self.scratch[0][:layout.rows * layout.cols].view(layout.rows, layout.cols)
            layout.from_blocks(coeffs[s:e].view(-1, layout.c1, layout.c2), natural)
            out[i] = idct_chunked(natural, layout.c1, layout.c2, scratch=self.scratch[1],
                                  out=self.updates[i]).view(shapes[i])

    def decode_into(self, idx: torch.Tensor, vals: torch.Tensor, out: list[torch.Tensor],
                    shapes: list[torch.Size]) -> None:
        """Mean-decode (blocks, m) contributions and inverse-transform them into ``out``."""
        flat = (self.block_base + (idx // self.c2) * self.block_stride + idx % self.c2).reshape(-1)
        mean_decode(flat, vals.reshape(-1), self.decoded.numel(), self.dtype, out=self.decoded)
        for (i, layout, _, _), offset in zip(self.members, self.natural_offsets, strict=True):
            natural = self.decoded[offset:offset + layout.rows * layout.cols]
            out[i] = idct_chunked(natural.view(layout.rows, layout.cols), layout.c1, layout.c2,
                                  scratch=self.scratch[1], out=self.updates[i]).view(shapes[i])
        self.decoded.scatter_(0, flat, 0.0)  # cheaper than refilling the whole buffer


class DeMoReplicator(Replicator):
    """DeMo: exchange the top-k DCT coefficients of the decoupled momentum in one bucket."""

    name = "demo"
    # The updates it returns are its own buffers, so the optimizer may modify them in place.
    owns_updates = True

    def __init__(self, topk: int = 32, chunk: int = 64, decay: float = 0.999,
                 value_dtype: torch.dtype = torch.bfloat16):
        self.topk, self.chunk, self.decay, self.value_dtype = topk, chunk, decay, value_dtype

    def setup(self, params: list[torch.Tensor], group: Group, ranks: int) -> None:
        super().setup(params, group, ranks)
        self.shapes = [p.shape for p in params]
        self.empty_like = [(p.shape, p.dtype, p.device) for p in params]
        groups: dict[tuple[int, int, torch.dtype], _BlockGroup] = {}
        for i, p in enumerate(params):
            if p.numel() == 0:
                continue  # FSDP2 can leave a rank with nothing of a small parameter.
            layout = BlockLayout.for_shape(p.shape, self.chunk)
            key = (layout.c1, layout.c2, p.dtype)
            if key not in groups:
                groups[key] = _BlockGroup(layout.c1, layout.c2, self.topk, p.dtype, p.device)
            groups[key].add(i, layout)
        # A fixed order (same on every replica, whose shards have the same shapes) defines the
        # wire layout.
        self.groups = [groups[k] for k in sorted(groups, key=lambda k: (k[0], k[1], str(k[2])))]
        specs = []
        for g in self.groups:
            g.allocate()
            specs.append(((g.num_blocks, g.k), index_dtype(g.c1 * g.c2)))
            specs.append(((g.num_blocks, g.k), self.value_dtype))
        self.segments, self.bucket_bytes = plan_bucket(specs)

    def _new_grads(self) -> list[torch.Tensor]:
        # Placeholders: scatter_back replaces every non-empty one.
        return [torch.zeros(s, dtype=d, device=dev) if math.prod(s) == 0
                else torch.empty(0, dtype=d, device=dev) for s, d, dev in self.empty_like]

    def accumulate(self, grads: list[torch.Tensor], lrs: list[float]) -> None:
        for g in self.groups:
            g.fold(grads, lrs, self.decay)

    def encode(self) -> list[torch.Tensor]:
        """Pick this step's top-k coefficients, remove them from delta; return wire tensors."""
        wire = []
        for g in self.groups:
            idx, vals = topk_encode(g.delta, g.k)
            sent = vals.to(self.value_dtype)
            if sent.dtype == g.delta.dtype:
                g.delta.scatter_(1, idx, 0.0)
            else:
                # Only the rounded value left this rank: the rounding error stays in delta.
                g.delta.scatter_(1, idx, vals - sent.to(g.delta.dtype))
            wire += [encode_indices(idx, g.c1 * g.c2), sent]
        return wire

    def decode(self, views: list[torch.Tensor], out: list[torch.Tensor]) -> None:
        """Mean-decode gathered (ranks, blocks, k) views and inverse-transform into ``out``."""
        for n, g in enumerate(self.groups):
            idx, vals = views[2 * n], views[2 * n + 1]
            ranks = idx.shape[0]
            idx = decode_indices(idx).permute(1, 0, 2).reshape(g.num_blocks, ranks * g.k)
            vals = vals.permute(1, 0, 2).reshape(g.num_blocks, ranks * g.k)
            g.decode_into(idx, vals, out, self.shapes)

    def start(self, grads: list[torch.Tensor], lrs: list[float],
              stats: CommStats) -> tuple[torch.Tensor | None, object | None]:
        """Fold the gradients into delta, encode, and launch the bucket's all-gather.

        Returns (gathered buffer, work handle); both None when nothing crosses the group.
        """
        self.accumulate(grads, lrs)
        if self.ranks == 1 or not self.groups:
            return None, None
        buf = pack(self.encode(), self.segments, self.bucket_bytes)
        gathered = torch.empty(self.ranks * self.bucket_bytes, dtype=torch.uint8,
                               device=buf.device)
        work = _all_gather_flat(gathered, buf, self.group)
        sent = all_gather_bytes(self.bucket_bytes, self.ranks)
        stats.add(sent, sent)
        return gathered, work

    def finish(self, pending: tuple[torch.Tensor | None, object | None]) -> list[torch.Tensor]:
        """Wait for :meth:`start`'s all-gather and decode the new gradients."""
        gathered, work = pending
        out = self._new_grads()
        if gathered is None:
            # Nothing to exchange: like the reference, the whole momentum becomes the update.
            for g in self.groups:
                g.scatter_back(g.delta.clone(), out, self.shapes)
                g.delta.zero_()
            return out
        if work is not None:
            work.wait()
        self.decode(unpack(gathered.view(self.ranks, self.bucket_bytes), self.segments), out)
        return out

    def replicate(self, grads: list[torch.Tensor], lrs: list[float],
                  stats: CommStats) -> list[torch.Tensor]:
        return self.finish(self.start(grads, lrs, stats))

    def state_dict(self) -> dict:
        return {"delta": [g.delta.clone() for g in self.groups]}

    def load_state_dict(self, state: dict) -> None:
        _copy_state([g.delta for g in self.groups], state["delta"])


class FullReplicator(Replicator):
    """Average the full shard gradient over the replicas with one bucketed all-reduce."""

    name = "full"

    def replicate(self, grads: list[torch.Tensor], lrs: list[float],
                  stats: CommStats) -> list[torch.Tensor]:
        if self.ranks == 1 or not grads:
            return grads
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat = self._all_reduce_mean(flat, stats)
        return [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in grads]), grads,
                                              strict=True)]


class NoReplicator(Replicator):
    """Keep every replica on its own gradients: no inter-node traffic."""

    name = "none"

    def replicate(self, grads: list[torch.Tensor], lrs: list[float],
                  stats: CommStats) -> list[torch.Tensor]:
        return grads


class _DeltaReplicator(Replicator):
    """Shared state of replicators that send part of a parameter-space momentum ``delta``."""

    def __init__(self, decay: float = 0.999, rate: float = 0.1):
        self.decay, self.rate = decay, rate

    def setup(self, params: list[torch.Tensor], group: Group, ranks: int) -> None:
        super().setup(params, group, ranks)
        self.delta = [torch.zeros_like(p) for p in params]

    def accumulate(self, grads: list[torch.Tensor], lrs: list[float]) -> None:
        for d, g, lr in zip(self.delta, grads, lrs, strict=True):
            d.mul_(self.decay).add_(g, alpha=lr)

    def _rows(self, d: torch.Tensor) -> torch.Tensor:
        """2-D view of ``d`` whose rows are the units this replicator selects from."""
        raise NotImplementedError

    def _selection(self) -> list[torch.Tensor | None]:
        raise NotImplementedError

    def replicate(self, grads: list[torch.Tensor], lrs: list[float],
                  stats: CommStats) -> list[torch.Tensor]:
        self.accumulate(grads, lrs)
        if self.ranks == 1:
            out = [d.clone() for d in self.delta]
            for d in self.delta:
                d.zero_()
            return out
        chosen = self._selection()
        parts = [self._rows(d)[rows].reshape(-1) for d, rows in zip(self.delta, chosen,
                                                                     strict=True)
                 if rows is not None]
        out = [torch.zeros_like(d) for d in self.delta]
        if not parts:
            return out
        flat = self._all_reduce_mean(torch.cat(parts), stats)
        offset = 0
        for d, o, rows in zip(self.delta, out, chosen, strict=True):
            if rows is None:
                continue
            view = self._rows(d)
            n = rows.numel() * view.shape[1]
            self._rows(o)[rows] = flat[offset:offset + n].view(rows.numel(), view.shape[1])
            view[rows] = 0.0
            offset += n
        return out

    def state_dict(self) -> dict:
        return {"delta": [d.clone() for d in self.delta]}

    def load_state_dict(self, state: dict) -> None:
        _copy_state(self.delta, state["delta"])


class RandomReplicator(_DeltaReplicator):
    """Average a seeded random subset of rows of delta each step (same rows on all replicas)."""

    name = "random"

    def __init__(self, decay: float = 0.999, rate: float = 0.1, seed: int = 42):
        super().__init__(decay, rate)
        self.seed = seed

    def setup(self, params: list[torch.Tensor], group: Group, ranks: int) -> None:
        super().setup(params, group, ranks)
        self.generator = torch.Generator().manual_seed(self.seed)

    def _rows(self, d: torch.Tensor) -> torch.Tensor:
        return d.view(matrix_shape(d.shape))

    def _selection(self) -> list[torch.Tensor | None]:
        sizes = [matrix_shape(d.shape)[0] if d.numel() else 0 for d in self.delta]
        # One draw per step shared by all shards, so replicas with equal shapes pick equal rows.
        scores = torch.rand(max(sizes, default=0), generator=self.generator)
        picks: dict[int, torch.Tensor] = {}
        out: list[torch.Tensor | None] = []
        for n in sizes:
            if n == 0:
                out.append(None)
                continue
            if n not in picks:
                m = max(1, int(self.rate * n))
                rows = torch.topk(scores[:n], m, largest=False).indices.sort().values
                picks[n] = rows.to(self.delta[0].device)
            out.append(picks[n])
        return out

    def state_dict(self) -> dict:
        return {**super().state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.generator.set_state(state["generator"])


class StridingReplicator(_DeltaReplicator):
    """Average a rotating, evenly strided subset of the chunks of delta each step."""

    name = "striding"

    def __init__(self, decay: float = 0.999, rate: float = 0.1, chunk: int = 64):
        super().__init__(decay, rate)
        self.chunk = chunk
        self.counter = 0

    def _rows(self, d: torch.Tensor) -> torch.Tensor:
        n = largest_divisor_at_most(d.numel(), self.chunk)
        return d.view(n, -1)

    def _selection(self) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for d in self.delta:
            if d.numel() == 0:
                out.append(None)
                continue
            n = self._rows(d).shape[0]
            m = max(1, int(self.rate * n))
            stride = math.ceil(n / m)
            # Shifting the comb by one each step visits every chunk within `stride` steps.
            offset = self.counter % stride
            out.append(torch.unique((offset + torch.arange(m) * stride) % n).to(d.device))
        self.counter += 1
        return out

    def state_dict(self) -> dict:
        return {**super().state_dict(), "counter": self.counter}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.counter = int(state["counter"])


class DiLoCoReplicator(Replicator):
    """DiLoCo: local inner steps, every ``sync_every`` steps an all-reduced pseudo-gradient
    drives an outer Nesterov SGD step from the last synchronised parameters."""

    name = "diloco"

    def __init__(self, sync_every: int = 50, outer_lr: float = 0.7, outer_momentum: float = 0.9):
        self.sync_every, self.outer_lr, self.outer_momentum = sync_every, outer_lr, outer_momentum
        self.inner_steps = 0

    def setup(self, params: list[torch.Tensor], group: Group, ranks: int) -> None:
        super().setup(params, group, ranks)
        self.anchor = [p.detach().clone() for p in params]
        self.momentum = [torch.zeros_like(p) for p in params]

    def replicate(self, grads: list[torch.Tensor], lrs: list[float],
                  stats: CommStats) -> list[torch.Tensor]:
        return grads

    def after_update(self, params: list[torch.Tensor], lrs: list[float],
                     stats: CommStats) -> None:
        self.inner_steps += 1
        if self.inner_steps % self.sync_every != 0:
            return
        pseudo = [a - p for a, p in zip(self.anchor, params, strict=True)]
        if self.ranks > 1 and pseudo:
            flat = self._all_reduce_mean(torch.cat([t.reshape(-1) for t in pseudo]), stats)
            pseudo = [t.view_as(p) for t, p in zip(flat.split([p.numel() for p in pseudo]),
                                                     pseudo, strict=True)]
        mu = self.outer_momentum
        for a, m, g, p in zip(self.anchor, self.momentum, pseudo, params, strict=True):
            m.mul_(mu).add_(g)
            a.sub_(g.add(m, alpha=mu), alpha=self.outer_lr)  # Nesterov look-ahead
            p.copy_(a)

    def state_dict(self) -> dict:
        return {"anchor": [a.clone() for a in self.anchor],
                "momentum": [m.clone() for m in self.momentum], "inner_steps": self.inner_steps}

    def load_state_dict(self, state: dict) -> None:
        _copy_state(self.anchor, state["anchor"])
        _copy_state(self.momentum, state["momentum"])
        self.inner_steps = int(state["inner_steps"])


REPLICATORS = ("demo", "full", "none", "random", "striding", "diloco")
