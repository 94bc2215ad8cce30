"""One run: launching its ranks, the rank body, the training loop, the run folder, the watchdog.

Where things live: ``command.py`` (`flexbench run`), ``launch.py`` (spawned ranks or torchrun),
``kernel.py`` (ranks in network namespaces behind kernel-shaped links), ``rank.py`` (one
launcher-watched rank: join, train, hand back, tear down), ``train.py`` (building the model and
optimizer and the training loop), ``schedule.py`` (the lr schedule, torch-free), ``folder.py``
(a run's working folder and what it writes), ``watchdog.py`` (heartbeats and the stall
watchdog).
"""
