"""The cost model against runs: replaying a trace, validating the model, calibrating links.

Where things live: ``simulate.py`` (`flexbench simulate`: a run's trace on another network or
cluster), ``validate.py`` (`flexbench validate-sim`: shaped runs against the model),
``calibrate.py`` (`flexbench calibrate`: goodput and per-message cost of this machine's links).
"""
