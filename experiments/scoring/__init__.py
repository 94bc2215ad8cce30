"""The statistics below both the replay and the report: targets, intervals, speed-ups, rankings.

Where things live: ``targets.py`` (time to target, the default target), ``intervals.py``
(medians over seeds with bootstrap intervals or ranges), ``speedups.py`` (per variant and network
point: time to target and paired speed-up), ``ranking.py`` (who is first, by how much, tie or
not), ``step_noise.py`` (times to target over a run's resampled compute), ``crossings.py``
(where two methods' times to target change order), ``formats.py`` (a score as table text),
``variants.py`` (a method and its knobs as one label).

`experiments.replay` (compare) and `experiments.report` (summary tables, figures) both build on
these; neither imports the other for them. Importing the package imports none of its modules.
"""
