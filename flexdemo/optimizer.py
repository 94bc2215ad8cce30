"""FlexDeMo: an optimizer handed a replicator, over (hybrid) sharded parameters."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from ._checks import check, float_dtype, in_unit_interval, int_at_least
from .bases import SignBase, make_base
from .knobs import DeMoKnobs, check_dct_chunk
from .replica_groups import replication_group_for
from .replicators import REPLICATORS, Replicator
from .wire import CommStats


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local part of ``t``: the shard of an FSDP2 DTensor, else ``t`` itself."""
    # DTensor.to_local() can hand back a tensor that does not alias the parameter's storage
    # (FSDP2 keeps a padded shard); in-place updates must reach the real local shard.
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _group_size(group: dist.ProcessGroup | None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _from_reference(replicator: Replicator | str, topk: int | None, chunk: int | None,
                    decay: float | None, value_dtype: torch.dtype | None,
                    chunking: str | None) -> Replicator:
    """The replicator the reference-compatible keywords describe."""
    given = {"compression_topk": topk, "compression_chunk": chunk, "compression_decay": decay,
             "value_dtype": value_dtype, "chunking": chunking}
    if isinstance(replicator, Replicator):
        for key, value in given.items():
            check(value is None, f"{key}={value!r} only applies with a replicator name; "
                                 "set it on the replicator object instead.")
        return replicator
    check(replicator in REPLICATORS,
          f"replicator={replicator!r} is unknown; use one of {', '.join(REPLICATORS)}.")
    if topk is not None:
        int_at_least("compression_topk", topk, 1)
    if chunk is not None and issubclass(REPLICATORS[replicator].knobs_type, DeMoKnobs):
        # Said here under the keyword's own name, not as the replicator's "chunk".
        check_dct_chunk("compression_chunk", chunk)
    elif chunk is not None:
        int_at_least("compression_chunk", chunk, 1)
    if decay is not None:
        in_unit_interval("compression_decay", decay, closed_low=True, closed_high=False)
    if value_dtype is not None:
        float_dtype("value_dtype", value_dtype)
    extra = {}
    if chunking is not None:
        check(replicator == "demo", f"chunking={chunking!r} only applies to replicator='demo', "
                                    f"not {replicator!r}.")
        extra["chunking"] = chunking
    return REPLICATORS[replicator].from_reference(topk=topk, chunk=chunk, decay=decay,
                                                  value_dtype=value_dtype, **extra)


class FlexDeMo(torch.optim.Optimizer):
    """Decoupled Momentum (DeMo) and its DeToNATION relatives on (hybrid) sharded parameters.

    ``FlexDeMo(params, lr, replicator=DeMoReplicator(topk=32, chunk=64), base="sign")``: each
    step works on the local shard of every parameter. On the steps its schedule says, the
    replicator exchanges (part of) the gradient or momentum with the other replicas over
    ``replication_group``; the base step (sign-SGD or AdamW, decoupled weight decay) applies
    the result. ``last_step_comm`` and ``comm_totals`` count the bytes and calls the
    replicator put on the replication group (what netsim records, in the optimizer's terms).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        compression_topk: int | None = None,
        compression_chunk: int | None = None,
        compression_decay: float | None = None,
        weight_decay: float = 0.0,
        sign: bool | None = None,
        replicator: Replicator | str = "demo",
        value_dtype: torch.dtype | None = None,
        sharding_group: dist.ProcessGroup | None = None,
        replication_group: dist.ProcessGroup | None = None,
        *,
        base: str | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        chunking: str | None = None,
    ) -> None:
        """Build the optimizer around ``replicator`` (an object, or a name of ``REPLICATORS``).

        Args:
            params: parameters (plain tensors or FSDP2 DTensors) or parameter groups.
            compression_topk / compression_chunk / compression_decay / value_dtype: the
                reference call's knobs; only with a replicator name, which they configure.
            sign: take the sign of the update before the base step (default: the replicator's).
                Without sign, a replicator whose update carries lr already (DeMo, random,
                striding: their momentum adds lr * grad) is applied as is by the sign base,
                so the step is lr x momentum, not lr^2 x momentum.
            sharding_group: accepted for the reference call and unused: FSDP2 does the
                intra-node reduce-scatter before the optimizer sees the gradients.
            replication_group: the group of ranks holding copies of this rank's parameters (for
                HSDP, the inter-node group: one rank per node). None: the default group for
                unsharded parameters; for FSDP2 DTensors sharded over more than one rank, the
                replicate dim of their mesh (:func:`flexdemo.replica_groups.replication_group_for`,
                which refuses a group that would average different shards).
            base: "sign" (SGD) or "adamw"; default: the replicator's.
            betas / eps: AdamW's, for ``base="adamw"``.
            chunking: "block" or "flat" (see :class:`DeMoReplicator`); only with
                ``replicator="demo"``.
        """
        del sharding_group  # see the docstring
        rep = _from_reference(replicator, compression_topk, compression_chunk,
                              compression_decay, value_dtype, chunking)
        check(isinstance(lr, (int, float)) and lr >= 0, f"lr={lr!r} must be a number >= 0.")
        check(weight_decay >= 0, f"weight_decay={weight_decay!r} must be >= 0.")
        check(0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0,
              f"betas={betas!r} must both lie in [0, 1).")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.sign = rep.default_sign if sign is None else sign
        self.replicator = rep
        replication_group = replication_group_for(self._trainable(), replication_group)
        self.replication_group = replication_group
        self.replicas = _group_size(replication_group)
        shards = [local_tensor(p.detach()) for p in self._trainable()]
        self.base = make_base(rep.default_base if base is None else base, shards, betas, eps)
        # The look-ahead is taken back by a sign step of its own (DeMoReplicator._correct).
        signed = self.sign and isinstance(self.base, SignBase)
        check(not getattr(rep, "lookahead", False) or signed,
              "lookahead=true needs the sign step (base sign, sign true), which its correction "
              "takes back; use lookahead=false with another base.")
        rep.setup(shards, replication_group, self.replicas)
        self.steps = 0
        self.last_step_comm = CommStats().as_dict()
        self.comm_totals = CommStats()

    def _trainable(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def _gather(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float], list[float]]:
        """Local shards, their gradients, learning rates and weight decays, in setup order."""
        shards, grads, lrs, wds = [], [], [], []
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                shard = local_tensor(p)
                shards.append(shard)
                # A parameter that took no part in the loss still moves with its replicas.
                grads.append(local_tensor(p.grad) if p.grad is not None
                             else torch.zeros_like(shard))
                lrs.append(group["lr"])
                wds.append(group["weight_decay"])
        return shards, grads, lrs, wds

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Replicate as the replicator's schedule says and update the local parameter shards."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.steps += 1
        stats = CommStats()
        shards, grads, lrs, wds = self._gather()
        replicating = self.replicator.replicates_on(self.steps)
        if replicating:
            updates = self.replicator.replicate(grads, lrs, stats)
        else:
            updates = self.replicator.accumulate(grads, lrs)
        if self.sign:
            # In place only on the replicator's own buffers, never on a user's .grad.
            owned = replicating and self.replicator.owns_updates
            updates = [u.sign_() if owned else u.sign() for u in updates]
        # lr is inside a momentum replicator's update: the sign base applies it as is, the
        # AdamW base divides it out (bases.AdamWBase.apply), so lr is applied once either way.
        carries_lr = replicating and not self.sign and self.replicator.lr_in_update
        self.base.apply(shards, updates, lrs, wds, carries_lr=carries_lr)
        if replicating:
            self.replicator.after_update(shards, stats)
        self.last_step_comm = stats.as_dict()
        self.comm_totals.add(stats.bytes_sent, stats.bytes_received, stats.calls)
        return loss

    def drain(self) -> None:
        """Wait for the replicator's exchange still in flight, if any; call after the last step.

        A replicator that overlaps its exchange with the next step (DeMo with delay=1) leaves
        one posted after the last step; it is waited on (no handle outlives the process group)
        and dropped, never applied. Stepping again afterwards starts over as a first step.
        """
        self.replicator.drain()

    def state_dict(self) -> dict:
        """Everything needed to resume: hyper-parameters, replicator and base state, counters."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"param_groups": groups, "steps": self.steps,
                "replicator_name": self.replicator.name,
                "replicator": self.replicator.state_dict(), "base": self.base.state_dict(),
                "comm_totals": self.comm_totals.as_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict` saved by an optimizer of the same configuration."""
        name = state_dict.get("replicator_name")
        check(name == self.replicator.name,
              f"state_dict comes from replicator {name!r} but this optimizer uses "
              f"{self.replicator.name!r}.")
        check(len(state_dict["param_groups"]) == len(self.param_groups),
              f"state_dict has {len(state_dict['param_groups'])} parameter groups but this "
              f"optimizer has {len(self.param_groups)}.")
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update(saved)
        self.steps = int(state_dict["steps"])
        self.replicator.load_state_dict(state_dict["replicator"])
        self.base.load_state_dict(state_dict["base"])
        totals = state_dict["comm_totals"]
        self.comm_totals = CommStats(totals["bytes_sent"], totals["bytes_received"],
                                     totals["calls"])

