"""`flexbench report`: figures and tables from a sweep's results folder (also what notebooks call).

Where things live: ``metrics.py`` (the summary tables in Markdown), ``figures.py`` (loss against
wall-clock, time to target, bytes per step, the frontier, and the command), ``graphs.py`` (the
gossip and Ada study: loss against degree and replica variance), ``crossover.py`` (the winner
map over bandwidth x latency and the bandwidth where a method overtakes hsdp-adamw),
``step_times.py`` (the step-time variation columns), ``validation.py`` (the shaped runs'
own-compute replays). The statistics are `experiments.scoring`'s; the replays (`--same-compute`,
the crossover bandwidths) are `experiments.replay`'s, which never imports this package.
"""

from __future__ import annotations

from experiments.lazy import lazy_names

# Name -> the module that defines it, imported on first use (PEP 562): importing the package
# (or one of its modules) loads nothing else.
_WHERE = {
    "Results": "figures",
    "frontier_table": "figures",
    "load_results": "figures",
    "plot_bytes_per_step": "figures",
    "plot_frontier": "figures",
    "plot_loss_vs_time": "figures",
    "plot_time_to_target": "figures",
    "results_folder": "figures",
    "write_report": "figures",
}

__all__ = sorted(_WHERE)


__getattr__, __dir__ = lazy_names(__name__, _WHERE)
