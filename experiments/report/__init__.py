"""`flexbench report`: figures and tables from a sweep's results folder (also what notebooks call).

Where things live: ``metrics.py`` (time to target, speed-ups, summary tables), ``figures.py``
(loss against wall-clock, time to target, bytes per step, the frontier, and the command),
``graphs.py`` (the gossip and Ada study: loss against degree and replica variance),
``intervals.py`` (medians over seeds with bootstrap intervals or ranges, paired speed-ups),
``ranking.py`` (who is first per network point, the margin, tie or not), ``crossover.py`` (the
winner map over bandwidth x latency and the bandwidth where a method overtakes hsdp-adamw),
``same_compute.py`` (`--same-compute`: the simulated rows replayed on one compute basis).
"""

from experiments.report.figures import (
    Results,
    configure,
    frontier_table,
    load_results,
    main,
    plot_bytes_per_step,
    plot_frontier,
    plot_loss_vs_time,
    plot_time_to_target,
    results_folder,
    write_report,
)

__all__ = [
    "Results",
    "configure",
    "frontier_table",
    "load_results",
    "main",
    "plot_bytes_per_step",
    "plot_frontier",
    "plot_loss_vs_time",
    "plot_time_to_target",
    "results_folder",
    "write_report",
]
