"""Planning a cluster you don't have: declared models, hardware and methods, replayed by netsim."""
